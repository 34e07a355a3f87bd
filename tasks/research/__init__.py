"""Research: features, the training and simulation of a model, walk-forward folds, the
statistics that say how sure a result is, the promotion gate, and the stage plans and
form that tie them to a run.
"""

"""quantloop: the research loop of a systematic trading desk as a Prefect plugin bundle."""

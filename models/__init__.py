"""PyTorch models of the order book."""

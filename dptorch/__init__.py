"""dptorch: differentially private training for PyTorch."""

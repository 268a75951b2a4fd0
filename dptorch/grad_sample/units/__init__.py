"""Token privacy units: several examples packed into one batch row, each its own unit.

``token_units.py`` the unit ids and their layout (pure functions); ``token_tracker.py`` follows the
tokens through a packed forward and refuses what joins two units; ``packed_affine.py`` per-unit norms
and clipped sums of Linear / Conv1D calls from the packed tensors; ``packed_loss.py`` the only loss a
packed forward accepts (each unit's own); ``per_sample_losses.py`` one loss per row of a model's outputs,
each normalised within its row (what the private Trainer and ``make_private(model_loss=)`` train on).
"""

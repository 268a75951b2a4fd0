"""The names the controller accepts: its grad sample modes and its loss reductions."""

#: ``hooks``, ``functorch`` and ``ew`` instantiate per-sample gradients; ``bk`` and ``ghost`` (Opacus'
#: name for the same method) form norms and clipped sums from what they kept (``book_keeping.py``).
GRAD_SAMPLE_MODES = ("hooks", "functorch", "bk", "ghost", "ew")
LOSS_REDUCTIONS = ("mean", "sum")

"""The norm algebra: per-sample gradient norms and clipped sums of maps linear in their weight, formed
from factors without instantiating a gradient per sample.

``linear_forms.py`` the Gram algebra of one use (``LinearForm``); ``shared_inputs.py`` several linear
layers that read one input (q/k/v); ``certified.py`` the rounding bound that makes a cancelling sum's
norm a certified upper bound.
"""

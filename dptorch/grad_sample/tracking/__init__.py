"""The batch tracker: which tensors of a capturing root forward carry the batch, and along which dim.

``mode.py`` holds the ``TorchFunctionMode``; ``tags.py`` the tags and how they classify a layer
call; ``origins.py`` the layer calls whose inputs carry no batch and where their outputs meet it;
``reads.py`` the parameters read outside their module's call on their way into such calls;
``memory.py`` the storages that hold batch data (aliases the tracker did not see made);
``watch.py`` the draw's watch, from a DP loader's hand-out to the root forward; ``unseen.py`` the
guard at torch's dispatcher for operations run with torch functions switched off;
``rules/`` the operations' rules by family, merged by ``registry.py``. Adding an operation's rule
means adding it to the ``RULES`` table of its family's file.
"""

from dptorch.grad_sample.tracking.mode import BatchTracker
from dptorch.grad_sample.tracking.origins import OriginCall, origin_grads, rows_to_dense
from dptorch.grad_sample.tracking.registry import RULES, UNFOLLOWED, register_batch_rule, remove_batch_rule
from dptorch.grad_sample.tracking.tags import INNER, PACKED, WEAK, CallBatch, Lost, classify, fed_no_batch, packed

__all__ = [
    "INNER",
    "PACKED",
    "RULES",
    "UNFOLLOWED",
    "WEAK",
    "BatchTracker",
    "CallBatch",
    "Lost",
    "OriginCall",
    "classify",
    "fed_no_batch",
    "origin_grads",
    "packed",
    "register_batch_rule",
    "remove_batch_rule",
    "rows_to_dense",
]

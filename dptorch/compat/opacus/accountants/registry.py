"""``opacus.accountants.registry``: the accountant table by name, ``register_accountant``, ``create_accountant``.

``_ACCOUNTANTS`` is dptorch's own table (:data:`dptorch.accounting.factory.ACCOUNTANTS`), so an
accountant registered here is also one ``make_private(accountant=...)`` and calibration accept.
"""

from dptorch.accounting.factory import ACCOUNTANTS as _ACCOUNTANTS
from dptorch.accounting.factory import create_accountant, register_accountant

__all__ = ["create_accountant", "register_accountant"]

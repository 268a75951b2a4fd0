"""``opacus.accountants.analysis``: only the ``rdp`` functions are provided."""

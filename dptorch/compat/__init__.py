"""Other libraries' import paths, served from one place.

* ``opacus/``: Opacus 1.6's paths, laid out as Opacus lays them out (``opacus/validators`` is
  ``opacus.validators``), each a re-export of the dptorch object or a thin keyword adapter. A script
  written for Opacus runs after renaming ``opacus`` to ``dptorch``: ``paths`` serves
  ``dptorch.validators`` from ``dptorch.compat.opacus.validators``, so the main tree holds no twins.
* ``paths``: that import hook, and the table of dptorch's own earlier paths (``dptorch.loss``,
  ``dptorch.noise_mechanisms``, ...) that keep working after a move.
* ``unmapped``: the error for a name with no dptorch counterpart.

dp-transformers' names are the HF integration's own (its scripts rename ``dp_transformers`` to
``dptorch.integrations.hf``): :mod:`dptorch.integrations.hf.dp_transformers_compat`.
"""

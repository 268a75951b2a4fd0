"""Integrations of dptorch with other training stacks.

``dptorch.integrations.hf``: HuggingFace ``Trainer``, TRL trainers (SFT, DPO), PEFT adapters.
Each integration is a subpackage, imported only on demand so that ``import dptorch`` stays light.
"""

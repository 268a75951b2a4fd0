"""PrivacyEngine: wires the controller, the DP optimizer, Poisson sampling and the accountant.

``make_private`` returns ``(module, optimizer, data_loader)`` in every mode. With
``wrap_model=False`` the module returned is the very object passed in and the controller is
``engine.hooks``; ``engine.detach()`` removes it without a trace.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import DataLoader

from dptorch.accounting import create_accountant, get_noise_multiplier
from dptorch.data.poisson import DPDataLoader
from dptorch.grad_sample import GradSampleHooks, GradSampleModule
from dptorch.noise import NoiseGenerator
from dptorch.optim.optimizer import DPOptimizer


class PrivacyEngine:
    """Make a model, optimizer and data loader private, and track the privacy spent.

    ``accountant`` is one of ``"pld"`` (default), ``"prv"``, ``"rdp"``, ``"gdp"``.
    ``secure_mode=True`` draws noise from a cryptographically secure generator.
    """

    def __init__(self, accountant: str = "pld", secure_mode: bool = False) -> None:
        self.accountant = create_accountant(accountant)
        self.secure_mode = secure_mode
        self.hooks: Optional[GradSampleHooks] = None
        self.optimizer: Optional[DPOptimizer] = None
        self.sample_rate: Optional[float] = None
        self.poisson_sampling: Optional[bool] = None

    # ------------------------------------------------------------------ set-up

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: Union[float, Sequence[float]],
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        clipping: str = "flat",
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
        noise_generator: Optional[Any] = None,
        strict: bool = True,
    ):
        """Return ``(module, optimizer, data_loader)`` ready for DP-SGD."""
        if self.hooks is not None and self.hooks.attached:
            raise RuntimeError("this PrivacyEngine already made a model private; call engine.detach() first")
        _check_optimizer_params_in_model(module, optimizer)
        if not module.training:
            raise ValueError("the model is in eval mode; call model.train() before make_private (eval mode captures no per-sample gradients)")
        dp_loader = _private_data_loader(data_loader, poisson_sampling)
        self.sample_rate = dp_loader.sample_rate
        self.poisson_sampling = poisson_sampling
        expected_batch_size = dp_loader.sample_rate * len(dp_loader.dataset)
        hooks_kwargs = dict(batch_first=batch_first, loss_reduction=loss_reduction, strict=strict,
                            grad_sample_mode=grad_sample_mode, keep_param_grads=False)
        if wrap_model:
            returned = GradSampleModule(module, **hooks_kwargs)
            self.hooks = returned.hooks
        else:
            self.hooks = GradSampleHooks(module, **hooks_kwargs)
            returned = module
        self.optimizer = DPOptimizer(
            optimizer,
            hooks=self.hooks,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            clipping=clipping,
            noise_generator=noise_generator or _default_noise_generator(self.secure_mode),
            secure_mode=self.secure_mode,
        )
        self.optimizer.attach_step_hook(self._account_step)
        return returned, self.optimizer, dp_loader

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader,
        target_epsilon: float,
        target_delta: float,
        max_grad_norm: Union[float, Sequence[float]],
        epochs: Optional[float] = None,
        steps: Optional[int] = None,
        **kwargs: Any,
    ):
        """``make_private`` with the smallest noise multiplier that meets ``(target_epsilon, target_delta)``."""
        if (epochs is None) == (steps is None):
            raise ValueError("give exactly one of epochs or steps")
        sample_rate = 1.0 / len(data_loader)
        total_steps = steps if steps is not None else int(math.ceil(epochs * len(data_loader)))
        noise_multiplier = get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            steps=total_steps,
            accountant=self.accountant.mechanism,
        )
        return self.make_private(
            module=module, optimizer=optimizer, data_loader=data_loader,
            noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, **kwargs,
        )

    def detach(self) -> None:
        """Remove the controller and the optimizer's listener; the model is exactly as before."""
        if self.optimizer is not None:
            self.optimizer.detach()
        if self.hooks is not None:
            self.hooks.cleanup()

    # ------------------------------------------------------------------ accounting

    def _account_step(self, optimizer: DPOptimizer) -> None:
        self.accountant.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=self.sample_rate)

    def get_epsilon(self, delta: float) -> float:
        """The epsilon spent so far at ``delta``."""
        return self.accountant.get_epsilon(delta)

    def privacy_report(self, delta: float) -> Dict[str, Any]:
        """What a model card needs: epsilon, delta, noise, sampling, steps, accountant, clipping."""
        opt = self.optimizer
        return {
            "epsilon": self.get_epsilon(delta) if len(self.accountant) else 0.0,
            "delta": delta,
            "noise_multiplier": opt.noise_multiplier if opt else None,
            "max_grad_norm": opt.max_grad_norm if opt else None,
            "sample_rate": self.sample_rate,
            "steps": len(self.accountant),
            "accountant": self.accountant.mechanism,
            "clipping": opt.clipping if opt else None,
            "sampling": "poisson" if self.poisson_sampling else None,
            "secure_mode": self.secure_mode,
        }

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self,
        path: Union[str, os.PathLike],
        *,
        module: nn.Module,
        optimizer: Optional[DPOptimizer] = None,
        data_loader: Optional[DataLoader] = None,
        extra: Optional[Dict[str, Any]] = None,
    ) -> None:
        """Save everything a run needs to continue exactly: weights, optimizer with its
        accumulator and noise RNG, accountant history, sampler state and torch's RNG."""
        state = {
            "module": _unwrap(module).state_dict(),
            "accountant": self.accountant.state_dict(),
            "torch_rng_state": torch.get_rng_state(),
            "extra": extra or {},
        }
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        if data_loader is not None and hasattr(data_loader, "state_dict"):
            state["data_loader"] = data_loader.state_dict()
        tmp = f"{os.fspath(path)}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)  # a run killed mid-save keeps its previous checkpoint

    def load_checkpoint(
        self,
        path: Union[str, os.PathLike],
        *,
        module: nn.Module,
        optimizer: Optional[DPOptimizer] = None,
        data_loader: Optional[DataLoader] = None,
    ) -> Dict[str, Any]:
        """Restore a checkpoint written by ``save_checkpoint``; returns its ``extra`` dict."""
        state = torch.load(path, weights_only=True)
        _unwrap(module).load_state_dict(state["module"])
        self.accountant.load_state_dict(state["accountant"])
        torch.set_rng_state(state["torch_rng_state"])
        if optimizer is not None and "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
        if data_loader is not None and "data_loader" in state:
            data_loader.load_state_dict(state["data_loader"])
        return state["extra"]


def _default_noise_generator(secure_mode: bool) -> Optional[NoiseGenerator]:
    """Seeded from torch's global RNG, so ``torch.manual_seed`` makes a run reproducible."""
    if secure_mode:
        return None  # the optimizer builds the secure generator
    return NoiseGenerator(seed=int(torch.randint(0, 2**62, (1,)).item()))


def _unwrap(module: nn.Module) -> nn.Module:
    return module._module if isinstance(module, GradSampleModule) else module


def _check_optimizer_params_in_model(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_params = {id(p) for p in module.parameters()}
    foreign = [
        tuple(p.shape) for group in optimizer.param_groups for p in group["params"] if id(p) not in model_params
    ]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not in the model (shapes {foreign[:3]}); "
            "ModuleValidator.fix and get_peft_model return a new model, so build the optimizer from "
            "model.parameters() of the model you pass, after them"
        )


def _private_data_loader(data_loader: DataLoader, poisson_sampling: bool) -> DPDataLoader:
    if isinstance(data_loader, DPDataLoader):
        return data_loader
    if not poisson_sampling:
        raise ValueError(
            "poisson_sampling=False is refused: a loader that shuffles into fixed-size batches does not give the "
            "subsampling guarantee the accountants assume, so its epsilon would be understated. Use "
            "poisson_sampling=True (the data loader is rebuilt with the same expected batch size), or pass a "
            "dptorch.data.DPDataLoader"
        )
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    try:
        return DPDataLoader.from_data_loader(data_loader, distributed=distributed)
    except (TypeError, ValueError) as err:
        raise ValueError(f"cannot derive the sample rate from the data loader: {err}") from err


"""PrivacyEngine: wires the controller, the DP optimizer, Poisson sampling and the privacy plan.

``make_private`` returns ``(module, optimizer, data_loader)`` in every mode. With
``wrap_model=False`` the module returned is the very object passed in and the controller is
``engine.hooks``; ``engine.detach()`` removes it without a trace.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import DataLoader

from dptorch.accounting import create_accountant
from dptorch.data.poisson import DPDataLoader
from dptorch.grad_sample import GradSampleHooks, GradSampleModule
from dptorch.grad_sample.hooks import is_attached
from dptorch.noise import NoiseGenerator
from dptorch.optim.optimizer import DPOptimizer
from dptorch.plan import PrivacyPlan, check_clipping


class PrivacyEngine:
    """Make a model, optimizer and data loader private, and track the privacy spent.

    ``accountant`` is one of ``"pld"`` (default), ``"prv"``, ``"rdp"``, ``"gdp"`` (the GDP
    approximation reports only; it cannot calibrate the noise). ``secure_mode=True`` draws the
    noise and the Poisson sampling from the OS CSPRNG.

    ``make_private`` builds the run's :class:`~dptorch.plan.PrivacyPlan` (``engine.plan``): the
    sample rate and steps per epoch of the Poisson sampler the run iterates, the noise multiplier,
    the clipping bound and the accountant. The optimizer, the report and the checkpoints read it;
    ``sample_rate``, ``noise_multiplier`` and ``accountant`` here are views of it.
    """

    def __init__(self, accountant: str = "pld", secure_mode: bool = False) -> None:
        self.accountant = create_accountant(accountant)
        self.secure_mode = secure_mode
        self.hooks: Optional[GradSampleHooks] = None
        self.optimizer: Optional[DPOptimizer] = None
        self.plan: Optional[PrivacyPlan] = None

    @property
    def sample_rate(self) -> Optional[float]:
        """The Poisson sample rate the sampler draws with and the accountant records (None before make_private)."""
        return self.plan.sample_rate if self.plan is not None else None

    @property
    def poisson_sampling(self) -> Optional[bool]:
        return (self.plan.sampling == "poisson") if self.plan is not None else None

    @property
    def noise_multiplier(self) -> Optional[float]:
        return self.plan.noise_multiplier if self.plan is not None else None

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
        """Return ``(module, optimizer, data_loader)`` ready for DP-SGD.

        ``noise_multiplier=0`` is accepted with a warning: clipping only, no privacy, and
        ``get_epsilon`` returns infinity.
        """
        dp_loader = self._check_and_prepare(module, optimizer, data_loader, poisson_sampling, clipping, max_grad_norm)
        plan = PrivacyPlan.for_sampler(dp_loader.batch_sampler, noise_multiplier=noise_multiplier,
                                       **self._plan_fields(max_grad_norm, clipping))
        return self._attach(module, optimizer, dp_loader, plan, batch_first=batch_first, loss_reduction=loss_reduction,
                            grad_sample_mode=grad_sample_mode, wrap_model=wrap_model, noise_generator=noise_generator,
                            strict=strict)

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
        """``make_private`` with the smallest noise multiplier that meets ``(target_epsilon, target_delta)``.

        The noise is calibrated at exactly the sample rate the Poisson sampler draws with and the
        steps the run takes: ``steps``, or ``epochs`` passes over the returned loader
        (``epochs * len(loader)`` draws), with this engine's accountant (not 'gdp').
        """
        if (epochs is None) == (steps is None):
            raise ValueError("give exactly one of epochs or steps")
        clipping = kwargs.pop("clipping", "flat")
        poisson_sampling = kwargs.pop("poisson_sampling", True)
        dp_loader = self._check_and_prepare(module, optimizer, data_loader, poisson_sampling, clipping, max_grad_norm)
        plan = PrivacyPlan.calibrated(
            target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs, steps=steps,
            sample_rate=dp_loader.batch_sampler.sample_rate, steps_per_epoch=dp_loader.batch_sampler.steps,
            num_units=dp_loader.batch_sampler.num_samples, **self._plan_fields(max_grad_norm, clipping),
        )
        return self._attach(module, optimizer, dp_loader, plan, **kwargs)

    def _check_and_prepare(self, module, optimizer, data_loader, poisson_sampling, clipping, max_grad_norm) -> DPDataLoader:
        """Every check that needs no plan, then the Poisson loader; nothing is attached yet."""
        if self.hooks is not None and self.hooks.attached:
            raise RuntimeError("this PrivacyEngine already made a model private; call engine.detach() first")
        if isinstance(module, GradSampleModule) or any(is_attached(m) for m in module.modules()):
            raise RuntimeError(
                f"{type(module).__name__} is already private (it is, or holds, a model with per-sample gradient hooks "
                "from an earlier make_private): a second engine would clip and noise every step twice and both would "
                "count its privacy. Keep using the first engine's model and optimizer, or call detach() on it first"
            )
        _check_optimizer_params_in_model(module, optimizer)
        if not module.training:
            raise ValueError("the model is in eval mode; call model.train() before make_private (eval mode captures no per-sample gradients)")
        names = {p: n for n, p in module.named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        check_clipping(clipping, max_grad_norm, params, [names.get(p, "?") for p in params])
        return _private_data_loader(data_loader, poisson_sampling, self.secure_mode)

    def _plan_fields(self, max_grad_norm, clipping) -> Dict[str, Any]:
        return dict(max_grad_norm=max_grad_norm, clipping=clipping, accountant=self.accountant,
                    secure_mode=self.secure_mode, track_draws=True)

    def _attach(self, module, optimizer, dp_loader, plan, *, batch_first=True, loss_reduction="mean",
                grad_sample_mode="hooks", wrap_model=True, noise_generator=None, strict=True):
        if plan.noise_multiplier == 0:
            warnings.warn(
                "noise_multiplier=0: the gradients are clipped but no noise is added, so the training is not "
                "differentially private (get_epsilon returns inf); use it only as a clipping-only ablation",
                UserWarning,
                stacklevel=3,
            )
        if self.plan is not None:  # a second make_private on this engine: its steps add to the same budget
            plan.steps, plan.unprotected_steps = self.plan.steps, self.plan.unprotected_steps
        hooks_kwargs = dict(batch_first=batch_first, loss_reduction=loss_reduction, strict=strict,
                            grad_sample_mode=grad_sample_mode, keep_param_grads=False)
        if wrap_model:
            returned = GradSampleModule(module, **hooks_kwargs)
            hooks = returned.hooks
        else:
            hooks = GradSampleHooks(module, **hooks_kwargs)
            returned = module
        try:
            dp_optimizer = DPOptimizer(
                optimizer,
                hooks=hooks,
                plan=plan,
                loss_reduction=loss_reduction,
                noise_generator=noise_generator or _default_noise_generator(self.secure_mode),
                secure_mode=self.secure_mode,
            )
        except Exception:
            hooks.cleanup()
            raise
        self.hooks, self.optimizer, self.plan = hooks, dp_optimizer, plan
        dp_loader.privacy_plan = plan  # the loader reports every draw it hands out to the plan
        return returned, dp_optimizer, dp_loader

    def detach(self) -> None:
        """Remove the controller and the optimizer's listener; the model is exactly as before."""
        if self.optimizer is not None:
            self.optimizer.detach()
        if self.hooks is not None:
            self.hooks.cleanup()

    # ------------------------------------------------------------------ accounting

    def get_epsilon(self, delta: float) -> float:
        """The epsilon spent so far at ``delta`` (infinite once a step ran with noise_multiplier=0)."""
        if self.plan is None:
            return self.accountant.get_epsilon(delta)
        return self.plan.epsilon(delta)

    def privacy_report(self, delta: float) -> Dict[str, Any]:
        """What a model card needs: epsilon, delta, noise, sampling, steps, accountant, clipping."""
        if self.plan is None:
            return {"epsilon": self.get_epsilon(delta), "delta": delta, "steps": len(self.accountant),
                    "accountant": self.accountant.mechanism, "secure_mode": self.secure_mode}
        return self.plan.report(delta)

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
            "plan": self.plan.state_dict() if self.plan is not None else None,
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
        if self.plan is not None and state.get("plan") is not None:
            self.plan.load_state_dict(state["plan"])  # refuses a different sampling before anything is loaded
        else:  # written before checkpoints held the plan
            self.accountant.load_state_dict(state["accountant"])
            if self.plan is not None:
                self.plan.steps = len(self.accountant)
        _unwrap(module).load_state_dict(state["module"])
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


def _private_data_loader(data_loader: DataLoader, poisson_sampling: bool, secure_mode: bool = False) -> DPDataLoader:
    if isinstance(data_loader, DPDataLoader):
        if secure_mode and not data_loader.batch_sampler.secure:
            raise ValueError(
                "secure_mode=True needs the Poisson sampling to come from the OS CSPRNG too, but this DPDataLoader "
                "draws from a seeded torch generator (whoever learns its seed can replay which samples each batch "
                "holds); build it with DPDataLoader(..., secure_mode=True), or pass a plain DataLoader"
            )
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
        return DPDataLoader.from_data_loader(data_loader, distributed=distributed, secure_mode=secure_mode)
    except (TypeError, ValueError) as err:
        raise ValueError(f"cannot derive the sample rate from the data loader: {err}") from err

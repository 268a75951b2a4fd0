"""The private Trainer's captured step (PrivacyArguments.capture_step): the eager trainer's run, bit for bit."""

import warnings

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from dptorch.grad_sample.errors import PerSampleGradientError  # noqa: E402
from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, PrivacyArguments  # noqa: E402
from tests.integrations.test_hf_trainer import TOKENIZER, make_trainer  # noqa: E402
from tests.integrations.tiny import lm_dataset, tiny_gpt2, without_dropout  # noqa: E402


def trained(tmp_path, capture, change=None, privacy=None, collator=None, **args):
    """A 3-step run of a tiny GPT-2 (no dropout, the same model, draws and noise whatever ``capture`` is), the model
    given to ``change`` first if given."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = without_dropout(tiny_gpt2(TOKENIZER))
    model = change(model) if change is not None else model
    privacy = dict(noise_multiplier=1.0, target_delta=1e-3, sampling_seed=1, noise_seed=2, capture_step=capture,
                   **(privacy or {}))
    trainer = make_trainer(tmp_path / str(capture), model=model, privacy=PrivacyArguments(**privacy), **args)
    if collator is not None:
        trainer.data_collator = collator
    trainer.train()
    return trainer


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if "loss" in h]


def assert_same_run(eager, captured, exact=True):
    for (name, p), q in zip(eager.model.named_parameters(), captured.model.parameters()):
        if exact:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert eager.privacy_budget.steps == captured.privacy_budget.steps == 3
    assert eager.get_epsilon() == captured.get_epsilon()


def test_the_captured_trainer_is_the_eager_trainer_bit_for_bit(tmp_path):
    """Each micro-batch size traced (capture_pad_to_multiple_of=1): one replay a micro-batch, the eager sums."""
    eager, captured = trained(tmp_path, False), trained(tmp_path, True, privacy={"capture_pad_to_multiple_of": 1})
    assert eager.dp_capture is None and captured.dp_capture.traces > 1
    assert_same_run(eager, captured)
    assert logged(eager, "loss") == logged(captured, "loss")
    assert logged(eager, "grad_norm") == logged(captured, "grad_norm")


def test_torch_compile_captures_by_default_and_compiles_the_graph(tmp_path):
    """``torch_compile=True`` alone: the step is captured and each graph compiled (the eager backend here, for time);
    fixed lengths (the collator's pad_to_multiple_of) and rows padded to a multiple of 8 trace one shape."""
    fixed = DataCollatorForPrivateCausalLanguageModeling(TOKENIZER, pad_to_multiple_of=32)
    eager = trained(tmp_path, False, collator=fixed)
    compiled = trained(tmp_path, None, collator=fixed, torch_compile=True, torch_compile_backend="eager",
                       privacy={"capture_pad_to_multiple_of": 8})
    assert compiled.dp_capture.compile == {"backend": "eager"} and compiled.dp_capture.traces == 1
    # the padded rows are masked (exactly 0 to the sums); the real rows' sums differ from the eager ones only by
    # the order of a matmul's reduction over more rows
    assert_same_run(eager, compiled, exact=False)
    # each row's loss is the step's, so the logged loss is the real rows' alone (the padding copies' left out)
    assert logged(compiled, "loss") == pytest.approx(logged(eager, "loss"), rel=1e-5)


@pytest.mark.parametrize("capture", [None, True])
def test_a_set_up_it_cannot_capture(tmp_path, capture):
    """User-level units: capture_step=True refuses before training; the default (torch_compile) steps eagerly."""
    dataset = lm_dataset(TOKENIZER, 32).map(lambda row, i: {"user": i // 2}, with_indices=True)
    privacy = PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, privacy_unit_column="user",
                               capture_step=capture)
    if capture:
        with pytest.raises(ValueError, match=r"capture_step=True.*privacy units"):
            make_trainer(tmp_path, dataset=dataset, privacy=privacy, torch_compile=True)
    else:
        trainer = make_trainer(tmp_path, dataset=dataset, privacy=privacy, torch_compile=True,
                               torch_compile_backend="eager")
        assert trainer.dp_capture is None


def reads_a_value(model):
    """``model`` with a forward pre-hook that reads a value of its input into Python (which a trace cannot hold)."""
    def check(module, args, kwargs):
        assert int(kwargs["input_ids"].max()) < module.config.vocab_size

    model.register_forward_pre_hook(check, with_kwargs=True)
    return model


def test_a_step_that_does_not_trace_runs_eagerly_by_default_and_is_refused_when_required(tmp_path):
    eager = trained(tmp_path, False, reads_a_value)
    with pytest.warns(UserWarning, match="runs its steps eagerly: captured step: the step reads a tensor's value"):
        fallen_back = trained(tmp_path, None, reads_a_value, torch_compile=True, torch_compile_backend="eager")
    assert fallen_back.dp_capture.gave_up is not None
    assert_same_run(eager, fallen_back)
    with pytest.raises(PerSampleGradientError, match="reads a tensor's value into Python"):
        trained(tmp_path, True, reads_a_value)


def test_a_privacy_refusal_is_raised_not_run_eagerly(tmp_path):
    """A loss that mixes the samples is refused by the trace as eagerly: never a fallback."""
    def batch_normalised(outputs, labels):
        logits = outputs.logits - outputs.logits.mean(0)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                 reduction="none").view(len(labels), -1).mean(1)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs its steps eagerly"
        with pytest.raises(PerSampleGradientError, match="derives from cross_entropy"):
            torch.manual_seed(0)
            trainer = make_trainer(tmp_path, privacy=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3),
                                   torch_compile=True, torch_compile_backend="eager")
            trainer._dp_recipe.per_sample_loss = batch_normalised
            trainer.train()


def test_cuda_graph_modes_are_refused_by_capture(tmp_path):
    with pytest.raises(ValueError, match="CUDA graphs"):
        make_trainer(tmp_path, privacy=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, capture_step=True),
                     torch_compile=True, torch_compile_mode="reduce-overhead")


@pytest.mark.parametrize("width", [None, 2])
def test_micro_batches_in_replays_of_a_fixed_width_trace_one_shape(tmp_path, width):
    """capture_rows_per_replay (by default per_device_train_batch_size, 4 here): every Poisson micro-batch, whatever
    its size, runs as replays of that many rows; the run is the eager one (within float32 rounding: the pieces' sums
    are added in their order) and so is its logged loss."""
    fixed = DataCollatorForPrivateCausalLanguageModeling(TOKENIZER, pad_to_multiple_of=32)
    eager = trained(tmp_path, False, collator=fixed)
    default = {} if width else dict(torch_compile=True, torch_compile_backend="eager")  # the torch_compile default
    captured = trained(tmp_path, None if default else True, collator=fixed, privacy={"capture_rows_per_replay": width},
                       **default)
    assert captured.dp_capture.rows_per_replay == (width or 4) and captured.dp_capture.traces == 1
    assert_same_run(eager, captured, exact=False)
    assert logged(captured, "loss") == pytest.approx(logged(eager, "loss"), rel=1e-5)


def test_row_options_of_a_run_that_steps_eagerly_are_named_unused(tmp_path):
    with pytest.warns(UserWarning, match=r"not used.*torch_compile=False|torch_compile=False.*not used"):
        make_trainer(tmp_path, privacy=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3,
                                                        capture_rows_per_replay=4))


@pytest.mark.parametrize("options, message", [
    (dict(capture_step="yes"), "capture_step must be"),
    (dict(capture_pad_to_multiple_of=0), "capture_pad_to_multiple_of must"),
    (dict(capture_rows_per_replay=True), "capture_rows_per_replay must"),
    (dict(capture_rows_per_replay=4, capture_step=False), "capture_rows_per_replay shapes .* capture_step=False"),
    (dict(capture_rows_per_replay=4, capture_pad_to_multiple_of=4), "not both"),
])
def test_capture_arguments_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        PrivacyArguments(noise_multiplier=1.0, **options)

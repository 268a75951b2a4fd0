import io

import numpy as np
import pytest
import torch

from dptorch.noise import (
    NoiseGenerator,
    SecureNoiseGenerator,
    gaussian_noise,
    secure_gaussian_numpy,
    secure_uniforms,
)

DRAWS = 1_000_000


def assert_gaussian_moments(values, std):
    values = np.asarray(values, dtype=np.float64)
    assert values.size >= DRAWS
    assert abs(values.std() / std - 1) < 0.02
    assert abs(values.mean()) < 5 * std / np.sqrt(values.size)
    kurtosis = np.mean((values / values.std()) ** 4)
    assert abs(kurtosis - 3) < 0.1  # rules out e.g. uniform noise with the right std


def test_default_noise_moments():
    std = 2.5
    noise = gaussian_noise(torch.empty(1000, 1000), std, generator=torch.Generator().manual_seed(0))
    assert noise.shape == (1000, 1000) and noise.dtype == torch.float32
    assert_gaussian_moments(noise.numpy(), std)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("secure", [False, True])
def test_half_precision_reference_gets_float32_noise(dtype, secure):
    reference = torch.zeros(7, 3, dtype=dtype)
    noise = gaussian_noise(reference, 1.0, secure=secure)
    assert noise.dtype == torch.float32 and noise.shape == reference.shape and noise.device == reference.device
    assert gaussian_noise(torch.zeros(3, dtype=torch.float64), 1.0).dtype == torch.float64


def test_generator_state_round_trip_reproduces_draws():
    noise_generator = NoiseGenerator(seed=3)
    gaussian_noise(torch.empty(10), 1.0, generator=noise_generator.generator)  # advance the stream
    buffer = io.BytesIO()
    torch.save(noise_generator.state_dict(), buffer)
    expected = noise_generator.noise_like(torch.empty(4, 5), 0.7)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["rng_state"].dtype == torch.uint8
    restored = NoiseGenerator(seed=12345)
    restored.load_state_dict(state)
    assert torch.equal(restored.noise_like(torch.empty(4, 5), 0.7), expected)
    assert not torch.equal(NoiseGenerator().noise_like(torch.empty(4, 5), 0.7), expected)


def test_secure_noise_moments_and_freshness():
    std = 0.8
    noise = gaussian_noise(torch.empty(DRAWS), std, secure=True)
    assert_gaussian_moments(noise.numpy(), std)
    assert not torch.equal(gaussian_noise(torch.empty(1000), std, secure=True),
                           gaussian_noise(torch.empty(1000), std, secure=True))
    secure = SecureNoiseGenerator()
    assert not torch.equal(secure.noise_like(torch.empty(100), 1.0), secure.noise_like(torch.empty(100), 1.0))


def test_secure_single_summand_and_uniforms():
    assert_gaussian_moments(secure_gaussian_numpy(DRAWS, 3.0, num_summands=1), 3.0)
    uniforms = secure_uniforms(100_000)
    assert uniforms.min() > 0 and uniforms.max() <= 1
    assert abs(uniforms.mean() - 0.5) < 5 * np.sqrt(1 / 12 / uniforms.size)


def test_secure_mode_has_no_replayable_state_and_rejects_generator():
    assert SecureNoiseGenerator().state_dict() == {}
    with pytest.raises(ValueError):
        SecureNoiseGenerator().load_state_dict({"rng_state": torch.zeros(3, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="generator"):
        gaussian_noise(torch.empty(3), 1.0, generator=torch.Generator(), secure=True)


def test_zero_std_and_invalid_std():
    assert torch.equal(gaussian_noise(torch.empty(5), 0.0), torch.zeros(5))
    assert torch.equal(gaussian_noise(torch.empty(5), 0.0, secure=True), torch.zeros(5))
    for std in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            gaussian_noise(torch.empty(5), std)


def test_large_cpu_draws_are_parallel_chunks_that_replay_whatever_the_threads():
    from scipy import stats

    from dptorch.noise.gaussian import _CPU_CHUNK

    reference = torch.zeros(3 * _CPU_CHUNK + 5)
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(3)
    try:
        torch.set_num_threads(2)
        first = gaussian_noise(reference, 1.5, generator=generator)
        second = gaussian_noise(reference, 1.5, generator=generator)
        generator.manual_seed(3)
        torch.set_num_threads(1)
        replay = gaussian_noise(reference, 1.5, generator=generator)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(first, replay)  # the generator's state decides, not the thread count
    assert not torch.equal(first, second)  # each draw advances the generator
    chunks = first[: 3 * _CPU_CHUNK].view(3, _CPU_CHUNK).double()
    assert abs(float(torch.corrcoef(chunks)[0, 1])) < 0.005  # chunks are not copies of one stream
    assert abs(float(torch.corrcoef(chunks)[1, 2])) < 0.005
    sample = (first[::7] / 1.5).double().numpy()
    assert stats.kstest(sample, "norm").pvalue > 1e-3


@pytest.mark.parametrize("threads", [1, 2])
def test_added_noise_is_the_flat_draw_whatever_the_targets(monkeypatch, threads):
    """``add_gaussian_noise_`` adds to each target its part of the flat draw, chunks straddling targets
    (empty ones too), with the same values ``gaussian_noise`` returns for the concatenation."""
    import dptorch.noise.gaussian as gaussian

    monkeypatch.setattr(gaussian, "_CPU_CHUNK", 10)
    torch.manual_seed(0)
    targets = [torch.randn(3, 4), torch.randn(0), torch.randn(25), torch.randn(1), torch.randn(2, 3)]
    held = [t.clone() for t in targets]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        gaussian.add_gaussian_noise_(targets, 0.3, torch.Generator().manual_seed(4))
    finally:
        torch.set_num_threads(before)
    flat = gaussian_noise(torch.zeros(sum(t.numel() for t in targets)), 0.3, torch.Generator().manual_seed(4))
    for t, h, z in zip(targets, held, flat.split([t.numel() for t in targets])):
        assert torch.equal(t.reshape(-1), h.reshape(-1) + z)

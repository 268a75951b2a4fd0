"""dptorch's one-run bounds equal JAX Privacy's auditor's on the same scores (skipped without jax-privacy).

JAX Privacy 2.0.0's ``CanaryScoreAuditor`` has both bounds: ``epsilon_one_run`` (Steinke, Nasr and
Jagielski) and ``epsilon_one_run_fdp`` (Mahloujifar, Melis and Chaudhuri). At one given threshold
(``Explicit``) each is the test of the ``k`` canaries scoring at or above it, as dptorch's at ``k``
guesses. Both root-find epsilon to 1e-6, so the two agree to that, far below the 4 digits reports print.
Install: ``pip install 'dptorch[audit-compare]'`` (jax-privacy and a CPU jax, about 400 MB).
"""

import numpy as np
import pytest

from dptorch.auditing import fdp_one_run_epsilon, one_run_epsilon
from dptorch.auditing.scores import top_guesses

jax_auditing = pytest.importorskip("jax_privacy.auditing", reason="jax-privacy is not installed")


@pytest.mark.parametrize("m, mu", [(200, 0.5), (1000, 1.5), (500, 3.0)])
@pytest.mark.parametrize("significance, delta", [(0.05, 1e-5), (0.01, 1e-6)])
def test_both_bounds_equal_jax_privacy_at_each_threshold(m, mu, significance, delta):
    rng = np.random.default_rng(m)
    included = rng.random(m) < 0.5
    scores = rng.standard_normal(m) + mu * included
    auditor = jax_auditing.CanaryScoreAuditor(scores[included], scores[~included])
    ranked = np.sort(scores)[::-1]
    nonzero = 0
    for k in (10, 20, 50, 100, m // 2):
        threshold = jax_auditing.Explicit(float(ranked[k - 1]))
        correct = top_guesses(scores, included, k)
        theirs = (auditor.epsilon_one_run(significance, delta, threshold_strategy=threshold),
                  auditor.epsilon_one_run_fdp(significance, delta, threshold_strategy=threshold))
        ours = (one_run_epsilon(m, k, correct, delta, significance),
                fdp_one_run_epsilon(m, k, correct, delta, significance))
        assert np.allclose(ours, theirs, rtol=0, atol=2e-6), (k, ours, theirs)
        nonzero += ours[1] > 0
    assert nonzero >= (1 if mu < 1 else 3)  # the comparison covers bounds above 0

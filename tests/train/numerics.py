"""Tolerances for comparing two float32 computations of the same training step, from an error analysis.

The equality tests of the training machinery (gradient cache, step strategies, two processes against one) come in
two kinds, with two analyses.

**Same forward, gradients summed in another order** (:class:`GradientContributions`). The reference embeds the
same micro-batches as the step under test (same rows, shapes and dropout masks) and applies the same head and loss
to the same assembled matrix, so every forward value and the gradient w.r.t. the embeddings are the same float32
computation on both sides (one process, same kernels, same shapes: bit-identical). A parameter's gradient is then
the sum of the same k contributions (one per micro-batch backward, per token term, ...), which autograd adds in
one order inside the reference's single backward and the step in another (``.grad`` accumulation). Any order of
k - 1 float additions errs by at most gamma(k - 1) * sum |g_i| per entry, gamma(m) = m u / (1 - m u) (Higham,
*Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 4.4, for every summation order), so

    |got - ref| <= 2 gamma(k - 1) * sum_i |g_i|        entry by entry, on any CPU

(k = 1: bit-identical). This bound is rigorous, not fitted, and tight: it scales with each entry's own
contributions, so an entry whose contributions cancel is held to their rounding, not to the tensor's largest
entry. It needs no conditioning of the loss: both sides see the same cosines, so a near-tie of the hinge is
decided the same way on both.

**Different forward** (:func:`conditioning`). Runs that embed other micro-batch shapes or shards (GEMM blocking
and the order in which rows are summed change; two processes all-reduce two halves) evaluate the same float32
function in a different order of operations, so their gradients differ by rounding alone, estimated here
relative to a tensor's largest entry. Each gradient entry comes out of a chain of about 50 reductions (2 layers
forward and backward, pooling, the head, cosines, the loss), each over at most 64 terms (the tiny test BERT's
intermediate size): with random rounding errors (Higham & Mary 2019) that is sqrt(50) * sqrt(64) ~ 57 ulps. The
loss amplifies it twice: a cosine error enters the softmax and the hinge divided by the temperature (x 20 at
0.05), and the gradient w.r.t. an embedding is a weighted difference of unit vectors, whose tangential part has
norm sin(angle) = sqrt(1 - cos^2): relative errors grow as kappa = 1 / sqrt(1 - max_cos^2). A BatchNorm layer
centres its input over the batch: an error of a few ulps of |x| becomes |x| / std(x) times larger relative to
its output (:func:`batchnorm_amplification`, a product over the layers). So

    rtol = 2 runs x 57 x (1 / temperature) x kappa x amplification x u        (u = 2^-24)

~7e-4 at kappa ~ 5 without BatchNorm. A wrong dropout replay, padding, set of negatives or routing of a gradient
is off by O(1), which any rtol <= 1e-3 resolves; a larger rtol means the step is too ill-conditioned to test much
(a test may accept up to 1e-2 where the mistakes it guards against are shown to be off by tens of percent).

The estimate needs a well-conditioned step, which :func:`conditioning` checks on the step's embeddings: cosines
below 1 (kappa), and, for PromCSE's hinge, no rounding-level near-tie in its two discontinuous choices (which
column is the hardest negative; whether the hinge is active), which rounding could otherwise flip between the two
runs (an O(1) difference in that row's gradient). A random tiny BERT's [CLS] vectors fail both: their cosines are
all within 1.5e-5 of 1 (kappa ~ 600 to 900, rtol ~ 0.1, far above such a gradient's whole scale) and hardest
negatives tie within 1e-7, below float32's resolution; mean pooling (cosines <= 0.98) or a stronger attention
output makes the vectors differ as a real encoder's do.
"""
from __future__ import annotations

import copy

import torch

U32 = 2.0 ** -24  # float32 unit roundoff
CHAIN_ULPS = 50 ** 0.5 * 64 ** 0.5
TIE_GAP = 1e-4  # >> the rounding of a cosine here (~1e-6: sqrt(32) ulps + the embeddings' own rounding)
MAX_RTOL = 1e-3  # what still tells rounding from a mistake that is off by O(1)


def _cosines(anchors: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    a = torch.nn.functional.normalize(anchors.double(), dim=-1)
    b = torch.nn.functional.normalize(columns.double(), dim=-1)
    return a @ b.T


def conditioning(embeddings: torch.Tensor, temperature: float, margin: float | None = None, *,
                 anchor_views: tuple[int, ...] = (0,), amplification: float = 1.0,
                 max_rtol: float = MAX_RTOL) -> float:
    """rtol for comparing two differently ordered float32 runs' gradients of this step (module docstring), after
    checking its assumptions.

    ``embeddings``: the (views, B, H) vectors the sentence objective sees. The anchors of each view in
    ``anchor_views`` meet the rows of every other view (a superset of the columns of any of the project's
    objectives, so kappa is an upper bound). ``margin``: the hinge's margin when the objective has PromCSE's
    hinge (then view 0 holds the anchors and row i of view 1 the positive of row i); only then are the
    hardest-negative and hinge-switch gaps checked (the softmax terms are smooth in the cosines).
    ``amplification``: of a BatchNorm head (:func:`batchnorm_amplification`)."""
    views, n = embeddings.shape[0], embeddings.shape[1]
    max_cos = -1.0
    for v in anchor_views:
        others = torch.cat([embeddings[w] for w in range(views) if w != v])
        max_cos = max(max_cos, float(_cosines(embeddings[v], others).max()))
    if margin is not None:
        assert anchor_views == (0,), "the hinge's anchors are view 0"
        cos = _cosines(embeddings[0], torch.cat(list(embeddings[1:])))  # positive of row i: column i
        pos = cos.diagonal().clone()
        neg = cos.clone()
        neg[range(n), range(n)] = float("-inf")
        top2 = neg.topk(2, dim=1).values
        tie = float((top2[:, 0] - top2[:, 1]).min())
        hinge = float((margin + top2[:, 0] - pos).abs().min())
        assert tie > TIE_GAP, f"hardest negative is a near-tie ({tie:.1e}): its choice would be decided by rounding"
        assert hinge > TIE_GAP, f"a hinge term is {hinge:.1e} from switching: rounding would decide it"
    assert max_cos < 1.0, "two embeddings point the same way: the comparison would be ill-conditioned"
    kappa = 1.0 / (1.0 - max_cos ** 2) ** 0.5
    rtol = 2 * CHAIN_ULPS * kappa * amplification / temperature * U32
    assert rtol <= max_rtol, (f"ill-conditioned step (max cosine {max_cos:.6f}, amplification {amplification:.3g}): "
                              f"rounding could reach {rtol:.1e}")
    return rtol


@torch.no_grad()
def batchnorm_amplification(head: torch.nn.Module, x: torch.Tensor) -> float:
    """Product over the BatchNorm1d layers of ``head`` (applied in training mode, to a copy) of the largest
    max_rows |x| / std(x) of a feature at its input: how much centring over the batch magnifies rounding."""
    factor = 1.0
    for module in copy.deepcopy(head).train().children():
        if isinstance(module, torch.nn.BatchNorm1d):
            std = x.double().std(0, unbiased=False)
            factor *= float((x.double().abs().max(0).values / std).max())
        x = module(x)
    return factor


def assert_same_gradients(a: dict, b: dict, rtol: float) -> None:
    """Every tensor of ``b`` agrees with ``a``'s within ``rtol`` of ``a``'s largest entry (rtol from
    :func:`conditioning`), and none is zero (a vacuous comparison)."""
    assert a.keys() == b.keys()
    for k in a:
        scale = float(a[k].abs().max())
        assert scale > 0, f"{k}: zero gradient, the comparison would be vacuous"
        err = float((a[k] - b[k]).abs().max())
        assert err <= rtol * scale, f"{k}: max difference {err:.3g} vs {rtol:.2g} x largest entry {scale:.3g}"


class GradientContributions:
    """Records, while active, every gradient contribution that reaches each named parameter (one per backward
    that reaches it): how many, and the sum of their absolute values (float64), for the summation-order bound
    of the module docstring."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = {n: p for n, p in params.items() if p.requires_grad}
        self.count = {n: 0 for n in self.params}
        self.abs_sum = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in self.params.items()}
        self._handles = []

    def _record(self, name: str, grad: torch.Tensor) -> None:
        self.count[name] += 1
        self.abs_sum[name] += grad.detach().double().abs().cpu()

    def __enter__(self) -> GradientContributions:
        self._handles = [p.register_hook(lambda g, n=n: self._record(n, g)) for n, p in self.params.items()]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def assert_equal_up_to_summation_order(self, got: dict, ref: dict) -> None:
        """``got`` (the recorded run's gradients) equals ``ref`` within 2 gamma(k - 1) sum |g_i| entry by entry,
        and no tensor is zero (a vacuous comparison)."""
        assert set(got) == set(ref)
        for name in ref:
            assert float(ref[name].abs().max()) > 0, f"{name}: zero gradient, the comparison would be vacuous"
            k = self.count[name]
            assert k >= 1, f"{name}: no gradient reached it in the recorded run"
            gamma = (k - 1) * U32 / (1 - (k - 1) * U32)
            # + the smallest normal float32 per addition: subnormal sums are rounded absolutely, not relatively
            bound = 2 * gamma * self.abs_sum[name] + 2 * (k - 1) * torch.finfo(torch.float32).tiny
            err = (got[name].double().cpu() - ref[name].double().cpu()).abs()
            worst = int((err - bound).argmax())
            assert bool((err <= bound).all()), (
                f"{name}: entry {worst} differs by {float(err.flatten()[worst]):.3g}, more than summing its {k} "
                f"contributions in another order can ({float(bound.flatten()[worst]):.3g})")

"""The two routes of certified products (``dptorch/grad_sample/norms/exact_products.py``) on this machine.

    python benchmarks/certified_products.py [--threads 1] [--repeats 5] [--device cuda]

For the products a step of ``benchmarks/models.py`` forms (B 16, T 128: the input Grams of width 256,
768 and 1024, the LM head's output-gradient Gram over a 5000-word vocabulary, an instantiated 256 x 256
gradient), prints the thread time of each route (minimum of ``--repeats``), the plain float32 product
for scale, and the split route's bound relative to ``||x_i|| ||y_j||`` on this random data (float32's
own worst case is ``n u``). CPU takes the float64 route on these figures; docs/performance.md quotes them.
On a GPU (``--device cuda``: wall time after synchronising, float32 matmuls at full precision) it shows
whether the split route pays where float64 is the slow lane.
"""

from __future__ import annotations

import argparse
import time

import torch

from dptorch.grad_sample.norms.exact_products import certified_gram, certified_product


def best_ms(fn, repeats: int, device: str) -> float:
    """Minimum over ``repeats`` of the thread time (CPU) or the synchronised wall time (CUDA)."""
    cuda = device.startswith("cuda")
    clock = time.perf_counter if cuda else time.thread_time
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        sync()
        best = min(best, clock() - start)
    return best * 1e3


def relative_bound(product, x: torch.Tensor, y: torch.Tensor) -> float:
    bound = sum(u.unsqueeze(2) * v.unsqueeze(1) for u, v in product.bounds)
    scale = x.double().norm(dim=2).unsqueeze(2) * y.double().norm(dim=1).unsqueeze(1)
    return float((bound / scale).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_float32_matmul_precision("highest")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b, t = args.batch, args.tokens
    new = lambda *shape: torch.randn(*shape, device=args.device)  # noqa: E731
    cases = [(f"Gram, width {n}", new(b, t, n), None) for n in (256, 768, 1024, 5000)]
    cases.append(("instantiated 256 x 256", new(b, 256, t), new(b, t, 256)))
    kind = "thread time" if args.device == "cpu" else f"wall time on {torch.cuda.get_device_name()}"
    print(f"B {b}, T {t}, {args.threads} thread(s), {kind}, min of {args.repeats}")
    print(f"| product | float32 (uncertified) | float64 route | split route | split / float64 | split bound (relative) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, x, y in cases:
        if y is None:
            plain = lambda: torch.bmm(x, x.transpose(1, 2))  # noqa: E731
            routes = [lambda r=r: certified_gram(x, r) for r in ("float64", "split")]
            y_ = x.transpose(1, 2)
        else:
            plain = lambda: torch.bmm(x, y)  # noqa: E731
            routes = [lambda r=r: certified_product(x, y, r) for r in ("float64", "split")]
            y_ = y
        f32, f64, split = (best_ms(fn, args.repeats, args.device) for fn in (plain, *routes))
        bound = relative_bound(routes[1](), x, y_)
        print(f"| {name} | {f32:.1f} ms | {f64:.1f} ms | {split:.1f} ms | {split / f64:.2f}x | {bound:.1e} |")


if __name__ == "__main__":
    main()

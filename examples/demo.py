"""Data-parallel least squares on 4 ranks: every rank fits the same model on its own shard.

Run with `tensorwire run -n 4 examples/demo.py`. Each step all-reduces the gradient
(averaged), so every rank holds identical weights; the final checks gather and compare them.
"""

import time

import numpy as np

import tensorwire as tw

world = tw.init()
rank, size = world.rank, world.size
rng = np.random.default_rng(1234)
true_w = rng.normal(size=256).astype(np.float32)  # same on every rank (same seed)

# Each rank draws its own shard of data.
local = np.random.default_rng(rank)
X = local.normal(size=(4096, 256)).astype(np.float32)
y = X @ true_w + 0.01 * local.normal(size=4096).astype(np.float32)

w = np.zeros(256, dtype=np.float32)
if rank == 0:
    w[:] = rng.normal(size=256)  # rank 0 picks the starting point ...
tw.broadcast(w, src=0)  # ... and everyone starts from it

start = time.perf_counter()
for step in range(200):
    grad = X.T @ (X @ w - y) / len(X)
    tw.all_reduce(grad, op=tw.ReduceOp.AVG)  # average of the shards' gradients
    w -= 0.05 * grad
    if step % 50 == 0 or step == 199:
        loss = np.array([np.mean((X @ w - y) ** 2)], dtype=np.float64)
        tw.all_reduce(loss, op=tw.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step:3d}  loss {loss[0]:.6f}")
elapsed = time.perf_counter() - start

# Every rank must hold bitwise the same weights: gather them all and compare.
all_w = np.empty((size, 256), dtype=np.float32)
tw.all_gather_into_tensor(all_w, w)
identical = all(np.array_equal(all_w[0], all_w[r]) for r in range(size))
error = float(np.abs(w - true_w).max())
hosts = [None] * size
tw.all_gather_object(hosts, {"rank": rank, "steps_per_s": 200 / elapsed})
if rank == 0:
    rate = np.median([h["steps_per_s"] for h in hosts])
    print(f"{size} ranks, 200 steps, {rate:.0f} steps/s per rank; weights identical on every rank: "
          f"{identical}; max |w - w_true| = {error:.4f}")
    assert identical and error < 0.05, "demo result is wrong"
tw.destroy()

"""``thing demo``: a training job in one process streaming tensors to this one.

It starts a server (or uses the one ``thing.serve()`` already started), runs
a small training loop in a separate Python process that catches

* ``loss`` every step,
* ``model.hidden.weight`` (the first layer's weight matrix) every 10 steps,
* ``activations``, a dict of the hidden layer's output and the prediction, every 10 steps,

then prints ``thing.summary()`` and ``thing.describe()`` of what arrived. The
model is a two-layer MLP fitting a smooth function of four inputs: a torch
model when torch is installed, else the same model in numpy trained by
hand-written gradient descent. ``python -m thing.demo --train`` runs only the
training half, sending wherever ``THING_SERVER``/``THING_PORT`` point.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

# The names the training process catches under (traced from its source text).
NAMES = ("loss", "model.hidden.weight", "activations")
STEPS = 100


def run(steps: int = STEPS, use_torch: bool | None = None, timeout: float = 120.0) -> int:
    """Run the whole demo in this process and a training subprocess; return an exit status."""
    from . import repl

    if use_torch is None:
        use_torch = importlib.util.find_spec("torch") is not None
    was_serving = repl._server is not None and repl._server.running
    server = repl.serve(port=0)  # a free port, unless a server already runs here
    try:
        print(f"thing demo: training a small {'torch' if use_torch else 'numpy'} model for "
              f"{steps} steps in another process, sending to port {server.port}...", flush=True)
        host = "127.0.0.1" if server.host in ("", "0.0.0.0", "::") else server.host
        status = _train_elsewhere(host, server.port, steps, use_torch, timeout)
        if status != 0:
            return status
        print("\n>>> thing.summary()", flush=True)
        repl.summary()
        for name in ("model.hidden.weight", "activations"):
            print(f"\n>>> thing.describe({name!r})", flush=True)
            repl.describe(name)
        print("\nNext: run `thing serve` here, call thing.catch(...) in your own training "
              "script, then try thing.get('loss'), thing.ingest_all() and thing.help().")
        return 0
    finally:
        if not was_serving:
            server.close()


def _train_elsewhere(host: str, port: int, steps: int, use_torch: bool, timeout: float) -> int:
    """Run the training half in a fresh interpreter and wait for it (at most ``timeout`` s)."""
    env = dict(os.environ, THING_SERVER=host, THING_PORT=str(port))
    command = [sys.executable, "-m", "thing.demo", "--train", "--steps", str(steps)]
    if not use_torch:
        command.append("--numpy")
    # "-m" puts the working directory first on sys.path: run where this very thing
    # package lives, so a source checkout in the current directory cannot shadow it.
    package_parent = Path(__file__).resolve().parent.parent
    process = subprocess.Popen(command, env=env, cwd=package_parent)
    try:
        status = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        print(f"thing demo: the training process did not finish within {timeout:.0f} s",
              file=sys.stderr)
        return 1
    if status != 0:
        print(f"thing demo: the training process failed (exit status {status})", file=sys.stderr)
    return status


# -- the training process -------------------------------------------------------------


def _data(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=(256, 4)).astype(np.float32)
    y = np.sin(x @ np.array([1.0, -2.0, 0.5, 1.0], np.float32))[:, None]
    return x, y.astype(np.float32)


def train_numpy(steps: int = STEPS, learning_rate: float = 0.2) -> Any:
    """Fit a 4-16-1 tanh MLP by hand-written gradient descent, catching as it goes."""
    import thing

    class Linear:
        def __init__(self, rng: np.random.Generator, n_in: int, n_out: int):
            scale = 1.0 / np.sqrt(n_in)
            self.weight = rng.normal(0.0, scale, (n_out, n_in)).astype(np.float32)
            self.bias = np.zeros(n_out, np.float32)

    class MLP:
        def __init__(self, rng: np.random.Generator):
            self.hidden = Linear(rng, 4, 16)
            self.out = Linear(rng, 16, 1)

    rng = np.random.default_rng(0)
    x, y = _data(rng)
    model = MLP(rng)
    handle = None
    for step in range(steps):
        hidden = np.tanh(x @ model.hidden.weight.T + model.hidden.bias)
        prediction = hidden @ model.out.weight.T + model.out.bias
        error = prediction - y
        loss = np.mean(error ** 2)
        # Backward pass of the mean squared error, layer by layer.
        d_prediction = 2.0 * error / len(x)
        d_hidden = (d_prediction @ model.out.weight) * (1.0 - hidden ** 2)
        model.out.weight -= learning_rate * (d_prediction.T @ hidden)
        model.out.bias -= learning_rate * d_prediction.sum(axis=0)
        model.hidden.weight -= learning_rate * (d_hidden.T @ x)
        model.hidden.bias -= learning_rate * d_hidden.sum(axis=0)

        handle = thing.catch(loss)
        # The weights change in place every step: copy=True sends a snapshot of this one.
        thing.catch(model.hidden.weight, every=10, copy=True)
        activations = {"hidden": hidden, "prediction": prediction}
        thing.catch(activations, every=10)
        _progress(step, steps, float(loss))
    return handle


def train_torch(steps: int = STEPS, learning_rate: float = 0.2) -> Any:
    """Fit the same MLP with torch, catching as it goes."""
    import torch

    import thing

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = torch.nn.Linear(4, 16)
            self.out = torch.nn.Linear(16, 1)

        def forward(self, x: Any) -> tuple[Any, Any]:
            hidden = torch.tanh(self.hidden(x))
            return hidden, self.out(hidden)

    torch.manual_seed(0)
    x, y = (torch.from_numpy(a) for a in _data(np.random.default_rng(0)))
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    handle = None
    for step in range(steps):
        hidden, prediction = model(x)
        loss = torch.nn.functional.mse_loss(prediction, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        handle = thing.catch(loss)
        # optimizer.step() updates the weights in place: copy=True sends a snapshot of this one.
        thing.catch(model.hidden.weight, every=10, copy=True)
        activations = {"hidden": hidden, "prediction": prediction}
        thing.catch(activations, every=10)
        _progress(step, steps, loss.item())
    return handle


def _progress(step: int, steps: int, loss: float) -> None:
    if step % 20 == 0 or step == steps - 1:
        print(f"  [training process] step {step:3d}  loss {loss:.4f}", flush=True)


def train(steps: int = STEPS, use_torch: bool | None = None) -> int:
    """The training process: train, then wait until the server stored the last capture."""
    if use_torch is None:
        use_torch = importlib.util.find_spec("torch") is not None
    handle = (train_torch if use_torch else train_numpy)(steps)
    # One connection delivers in order: once the last loss is stored, everything before it is.
    if handle is not None and not handle.wait(30):
        print(f"  [training process] the server did not store the last capture: {handle.error}",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m thing.demo",
                                     description=__doc__.split("\n")[0].strip("`"))
    parser.add_argument("--train", action="store_true",
                        help="run only the training process (sends to THING_SERVER/THING_PORT)")
    parser.add_argument("--steps", type=int, default=STEPS,
                        help="training steps (default %(default)s)")
    parser.add_argument("--numpy", action="store_true", help="use numpy even if torch is installed")
    args = parser.parse_args(argv)
    use_torch = False if args.numpy else None
    if args.train:
        return train(args.steps, use_torch)
    return run(args.steps, use_torch)


if __name__ == "__main__":
    sys.exit(main())

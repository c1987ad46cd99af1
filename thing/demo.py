"""The demo's training job: a small model that catches its tensors as it trains.

``thing demo`` (see ``cli.py``) runs it in a separate process, sending to a
server of its own, then shows what arrived. It catches

* ``loss`` every step,
* ``model.hidden.weight`` (the first layer's weight matrix) every 10 steps,
* ``activations``, a dict of the hidden layer's output and the prediction, every 10 steps.

The model is a two-layer MLP fitting a smooth function of four inputs: a torch
model when torch is installed, else the same model in numpy trained by
hand-written gradient descent. ``python -m thing.demo`` runs it alone, sending
wherever ``THING_SERVER``/``THING_PORT`` point; its progress goes to the
``thing.demo`` logger, like any training job's own logging.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from typing import Any

import numpy as np

STEPS = 100

log = logging.getLogger("thing.demo")


def _data(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=(256, 4)).astype(np.float32)
    y = np.sin(x @ np.array([1.0, -2.0, 0.5, 1.0], np.float32))[:, None]
    return x, y.astype(np.float32)


def train_numpy(steps: int = STEPS, learning_rate: float = 0.2) -> Any:
    """Fit a 4-16-1 tanh MLP by hand-written gradient descent, catching as it goes."""

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

        handle = _catch_step(loss, model, hidden, prediction)
        _progress(step, steps, float(loss))
    return handle


def train_torch(steps: int = STEPS, learning_rate: float = 0.2) -> Any:
    """Fit the same MLP with torch, catching as it goes."""
    import torch

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

        handle = _catch_step(loss, model, hidden, prediction)
        _progress(step, steps, loss.item())
    return handle


def _catch_step(loss: Any, model: Any, hidden: Any, prediction: Any) -> Any:
    """A step's catch lines, as a training loop has them. One place for both loops: the same
    expression caught in two functions of a file is two names (``loss``, ``loss_1``)."""
    import thing

    handle = thing.catch(loss)
    # The weights change in place every step (optimizer.step(), or by hand): copy=True sends
    # a snapshot of this one.
    thing.catch(model.hidden.weight, every=10, copy=True)
    activations = {"hidden": hidden, "prediction": prediction}
    thing.catch(activations, every=10)
    return handle


def _progress(step: int, steps: int, loss: float) -> None:
    if step % 20 == 0 or step == steps - 1:
        log.info("step %3d  loss %.4f", step, loss)


def train(steps: int = STEPS, use_torch: bool | None = None) -> int:
    """The training process: train, then wait until the server stored the last capture."""
    if use_torch is None:
        use_torch = importlib.util.find_spec("torch") is not None
    handle = (train_torch if use_torch else train_numpy)(steps)
    # One connection delivers in order: once the last loss is stored, everything before it is.
    if handle is not None and not handle.wait(30):
        log.error("the server did not store the last capture: %s", handle.error)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m thing.demo",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS,
                        help="training steps (default %(default)s)")
    parser.add_argument("--numpy", action="store_true", help="use numpy even if torch is installed")
    args = parser.parse_args(argv)
    # The job's own entry point shows its own progress, as a training script would (and
    # stops showing it, without a word, when its reader has gone: `thing demo | head`).
    logging.raiseExceptions = False
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("  [training process] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        return train(args.steps, use_torch=False if args.numpy else None)
    except KeyboardInterrupt:  # Ctrl+C: `thing demo`, its parent, says so
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The one trainer factory the tests share (also the ``make_trainer`` fixture)."""

import optax

import shardplug


def reference_trainer(
    model="mlp", strategy="dp", *, adapter="nnx", optimizer=None, addons=(), **kwargs
):
    """A reference model (a name or a ``ReferenceModel``) and a trainer of it: Adam at the
    model's learning rate unless ``optimizer`` is given; ``addons`` wrap the strategy."""
    model = shardplug.get_model(model) if isinstance(model, str) else model
    if addons:
        strategy = shardplug.get_strategy(strategy, addons=list(addons))
    task = shardplug.Task(
        model.adapter(adapter), kwargs.pop("loss_fn", model.loss_fn),
        optimizer or optax.adam(model.learning_rate), data=(),
    )  # fmt: skip
    return model, task.trainer(strategy=strategy, **kwargs)


def said(err: str) -> list[str]:
    """What a command said on standard error besides a run's first lines (the optimizer it
    trains with, the devices it uses and why: said by every run)."""
    import re

    first = re.compile(r"^shardplug: (\S+ on \d+ \w+ devices?( in \d+ processes)? \(|optimizer )")
    return [line for line in err.splitlines() if line and not first.match(line)]

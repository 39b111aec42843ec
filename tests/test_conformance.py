"""shardplug's own strategies, parallelisms and compositions pass the conformance suite it ships.

With ``test_strategies.py`` (one device equals each framework's own plain loop) this is the
matrix: every strategy x every adapter x every reference model trains like one device.
"""

from shardplug.testing import StrategyConformance


class TestDP(StrategyConformance):
    strategy = "dp"


class TestFSDP(StrategyConformance):
    strategy = "fsdp"


class Test2D(StrategyConformance):
    strategy = "2d"
    mesh = "data=2,model=4"


class TestPmap(StrategyConformance):
    strategy = "pmap"


class TestTP(StrategyConformance):
    strategy = "tp"


# Compositions run the same suite as strategies.


class TestDPFSDP(StrategyConformance):
    strategy = "dp+fsdp"


class TestFSDPTP(StrategyConformance):
    strategy = "fsdp+tp"


class TestDPFSDPTP(StrategyConformance):
    strategy = "dp+fsdp+tp"
    mesh = "data=2,fsdp=2,model=2"


class TestPipeline(StrategyConformance):
    strategy = "pp+dp"
    mesh = "stage=4,data=2"
    model_options = {"layers": 4}  # noqa: RUF012 (a class attribute the suite reads)


class TestContext(StrategyConformance):
    strategy = "fsdp+cp+tp"
    mesh = "fsdp=2,context=2,model=2"


class TestExpert(StrategyConformance):
    strategy = "fsdp+ep"
    mesh = "fsdp=2,expert=4"
    options = {"min_size": 0}  # noqa: RUF012 (a class attribute the suite reads)

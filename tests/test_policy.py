from vllm_kvdisk.core.policy import LoadCostModel


def test_loads_everything_until_it_has_measurements():
    m = LoadCostModel()
    assert m.choose([(10**9, 100)]).files == 1
    m.observe_load(10**9, 1.0)
    assert not m.ready and m.choose([(10**9, 100)]).files == 1


def test_slow_store_recomputes_fast_store_loads():
    m = LoadCostModel()
    m.observe_step(4096, 1.0)  # prefill: 4096 tokens/s
    m.observe_step(10, 1.0)  # a decode step says nothing about prefill speed
    m.observe_load(100_000_000, 1.0)  # the store delivers 100 MB/s
    # 128 KiB/token: 4096 tokens = 512 MiB -> 5.4 s to read vs 1 s to recompute.
    d = m.choose([(4096 * 131072, 4096)])
    assert d.files == 0 and d.load_s > d.recompute_s
    # 4 KiB/token: 16 MiB -> 0.17 s to read vs 1 s to recompute.
    d = m.choose([(4096 * 4096, 4096)])
    assert d.files == 1 and d.load_s < d.recompute_s


def test_estimates_follow_the_machine():
    m = LoadCostModel()
    m.observe_step(1000, 1.0)
    for _ in range(30):
        m.observe_load(10_000_000, 1.0)  # the disk got slow
    assert abs(m.bandwidth.value - 10_000_000) < 1
    assert m.choose([(50_000_000, 1000)]).files == 0


def test_a_declined_store_is_measured_again_after_a_while():
    now = [0.0]
    m = LoadCostModel(clock=lambda: now[0], reprobe_s=300)
    m.observe_step(1000, 1.0)
    m.observe_load(1_000_000, 1.0)  # 1 MB/s: far slower than recomputing
    chain = [(50_000_000, 1000)]
    now[0] = 299
    assert m.choose(chain).files == 0
    now[0] = 301
    d = m.choose(chain)
    assert d.files == 1 and d.probe  # one load to re-measure...
    assert m.choose(chain).files == 0  # ...and not another until the next period
    m.observe_load(10_000_000_000, 1.0)  # the store is fast again
    m.observe_load(10_000_000_000, 1.0)
    assert m.choose(chain).files == 1

"""set_config() and the per-process memory fraction."""

import math

import pytest

import ccalloc
from conftest import GiB, MiB, run_python


# --------------------------------------------------------------------------------------------
# set_config
# --------------------------------------------------------------------------------------------


def test_max_split_size(fresh_stats):
    ccalloc.set_config("max_split_size_mb:256")
    assert ccalloc.memory_stats()["max_split_size"] == 256 * MiB
    assert ccalloc.memory_stats(1)["max_split_size"] == 256 * MiB  # every device
    ccalloc.set_config(" max_split_size_mb : 512 ")  # whitespace around keys and values
    assert ccalloc.memory_stats()["max_split_size"] == 512 * MiB


def test_roundup_power2_divisions(alloc, fresh_stats):
    size = 1_100_000  # between 1 MiB and 2 MiB
    p = alloc(size)
    plain = ccalloc.memory_allocated()
    ccalloc.free(p)
    assert plain == 1100288  # a multiple of 512
    ccalloc.set_config("roundup_power2_divisions:4")
    q = alloc(size)
    assert ccalloc.memory_allocated() == 1310720  # next quarter step: 1.25 MiB
    ccalloc.free(q)
    ccalloc.set_config("roundup_power2_divisions:[1:4,>:0]")
    r = alloc(size)
    assert ccalloc.memory_allocated() == 1310720
    ccalloc.free(r)


def test_per_process_memory_fraction_key():
    ccalloc.set_config("per_process_memory_fraction:0.5")
    assert ccalloc.get_per_process_memory_fraction(0) == 0.5
    assert ccalloc.get_per_process_memory_fraction(1) == 0.5


def test_garbage_collection_threshold_in_a_fresh_process():
    # Once set it cannot be switched off again (0 is refused, as in PyTorch): own process.
    result = run_python(
        """
        import ccalloc
        ccalloc.set_config("garbage_collection_threshold:0.6,max_split_size_mb:64")
        MiB = 1 << 20
        ps = [ccalloc.malloc(200 * MiB) for _ in range(14)]  # 2800 MiB of 4096
        for p in ps:
            ccalloc.free(p)
        assert ccalloc.memory_reserved() == 2800 * MiB
        # Above 60% of the limit, old cached segments are released before growing (without
        # the threshold, 2800 + 1000 MiB would fit and all of it would stay reserved).
        p = ccalloc.malloc(1000 * MiB)
        print(ccalloc.memory_reserved() // MiB)
        ccalloc.free(p)
        """
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) < 3800


@pytest.mark.parametrize(
    "conf, message",
    [
        ("bogus:1", 'unknown config key "bogus" (known keys: '),
        ("max_split_size_mb", '"max_split_size_mb" is not key:value'),
        ("max_split_size_mb:1", "max_split_size_mb must be >= 20 (got 1)"),
        ("max_split_size_mb:lots", 'max_split_size_mb: "lots" is not a valid number'),
        ("garbage_collection_threshold:1.5", "garbage_collection_threshold must be between 0 and 1"),
        ("per_process_memory_fraction:2", "per_process_memory_fraction must be within [0, 1]"),
        ("roundup_power2_divisions:3", "divisions must be a power of two or 0 (got 3)"),
        ("roundup_power2_divisions:[256:1", "unbalanced '['"),
        ("page_slack:20", "page_slack must be within [0, 16]"),
    ],
)
def test_bad_config(conf, message):
    before = ccalloc.memory_stats()["max_split_size"]
    with pytest.raises(ccalloc.ConfigError) as info:
        ccalloc.set_config(conf)
    assert message in info.value.message
    assert info.value.status is ccalloc.Status.CONFIG_ERROR
    assert isinstance(info.value, ValueError)
    assert ccalloc.memory_stats()["max_split_size"] == before


def test_bad_config_changes_nothing():
    with pytest.raises(ccalloc.ConfigError):
        ccalloc.set_config("max_split_size_mb:256,bogus:1")
    assert ccalloc.memory_stats()["max_split_size"] == -1


@pytest.mark.parametrize("conf", [None, 256, b"max_split_size_mb:256"])
def test_config_must_be_str(conf):
    with pytest.raises(TypeError):
        ccalloc.set_config(conf)


def test_config_with_nul_is_refused():
    with pytest.raises(ValueError):
        ccalloc.set_config("max_split_size_mb:256\0bogus")


# --------------------------------------------------------------------------------------------
# set_per_process_memory_fraction (PyTorch's validation)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [1, 0, "0.5", None, True])
def test_fraction_must_be_float(fraction):
    with pytest.raises(TypeError, match=r"^Invalid type for fraction argument, must be `float`$"):
        ccalloc.set_per_process_memory_fraction(fraction)


@pytest.mark.parametrize("fraction", [-0.1, 1.0000001, 2.0, math.inf, -math.inf, math.nan])
def test_fraction_must_be_within_0_and_1(fraction):
    with pytest.raises(ValueError, match=r"^Invalid fraction value: .*\. Allowed range: 0~1$"):
        ccalloc.set_per_process_memory_fraction(fraction)
    assert ccalloc.get_per_process_memory_fraction() == 1.0


def test_default_fraction_is_one():
    assert ccalloc.get_per_process_memory_fraction() == 1.0
    assert ccalloc.get_per_process_memory_fraction("cuda:1") == 1.0


def test_fraction_limits_reservations(alloc, fresh_stats):
    ccalloc.set_per_process_memory_fraction(0.25)  # 1 GiB of 4 GiB
    assert ccalloc.get_per_process_memory_fraction() == 0.25
    assert ccalloc.get_per_process_memory_fraction(1) == 1.0  # per device
    p = alloc(900 * MiB)
    with pytest.raises(ccalloc.OutOfMemoryError) as info:
        alloc(200 * MiB)
    assert "Limit 1.00 GiB from per_process_memory_fraction." in info.value.message
    assert ccalloc.memory_stats()["num_ooms"] == 1
    ccalloc.free(p)
    # Device 1 is not limited.
    q = alloc(2 * GiB, device=1)
    ccalloc.free(q, device=1)


def test_fraction_zero_refuses_everything(alloc):
    ccalloc.set_per_process_memory_fraction(0.0, device=1)
    with pytest.raises(ccalloc.OutOfMemoryError):
        alloc(512, device=1)
    ccalloc.set_per_process_memory_fraction(1.0, device=1)
    alloc(512, device=1)


def test_fraction_on_missing_device():
    with pytest.raises(ccalloc.InvalidDeviceError):
        ccalloc.set_per_process_memory_fraction(0.5, device=5)

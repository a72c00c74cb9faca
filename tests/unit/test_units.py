"""Byte figures in messages switch units, so a refusal's figures show the difference it refuses on."""

from offload_core.units import size_text


def test_sizes_switch_units_and_never_read_zero():
    assert [size_text(n) for n in (0, 1, 1023, 1024, 1536 << 10, 3 << 30)] == \
        ["0 bytes", "1 byte", "1023 bytes", "1 KiB", "1.5 MiB", "3.00 GiB"]

"""`proj.calibration`: per-projection device scalars that keep their identity across updates."""

from __future__ import annotations

import pytest
import torch

from policyzoo.proj.calibration import DeviceScalars, check_values, load_values, save_values


def test_device_scalars_are_made_once_and_updated_in_place():
    values = {"0.q": 1.0, "0.k": 2.0, "0.v": 3.0}
    scalars = DeviceScalars(values, "threshold", "calibrate first")
    group = (("0.q", "0.k", "0.v"), (32, 16, 16))
    scalars.install(torch.device("cpu"), [group])
    q, columns = scalars.scalar("0.q", torch.device("cpu")), scalars.columns(group[0])
    assert columns.shape == (1, 64) and columns[0, :32].eq(1).all() and columns[0, 48:].eq(3).all()
    values.update({"0.q": 5.0, "0.v": 7.0})
    scalars.refresh()
    scalars.install(torch.device("cpu"), [group])  # a second install keeps the tensors a step may hold
    assert scalars.scalar("0.q", torch.device("cpu")) is q and scalars.columns(group[0]) is columns
    assert float(q) == 5.0 and columns[0, :32].eq(5).all() and columns[0, 48:].eq(7).all()
    with pytest.raises(ValueError, match="no threshold for projection '1.q': calibrate first"):
        scalars.scalar("1.q", torch.device("cpu"))


def test_groups_with_an_uncalibrated_member_get_no_columns():
    scalars = DeviceScalars({"0.gate": 1.0}, "ratio", "calibrate first")
    scalars.install(torch.device("cpu"), [(("0.gate", "0.up"), (16, 16))])
    assert scalars.columns(("0.gate", "0.up")) is None


def test_values_round_trip_and_are_checked(tmp_path):
    path = save_values(tmp_path / "v.safetensors", {"0.q": 0.25, "3.down": 1.5}, {"keep": "0.5", "kind": "x"})
    meta, values = load_values(path)
    assert meta == {"keep": "0.5", "kind": "x"} and values == {"0.q": 0.25, "3.down": 1.5}
    for bad, err in (({"0.q": float("nan")}, ValueError), ({0: 1.0}, TypeError), ([("0.q", 1.0)], TypeError)):
        with pytest.raises(err, match="ratios"):
            check_values(bad, "ratios")


def test_calibrated_values_must_fit_the_model_they_are_installed_on(tmp_path):
    """Thresholds (or fast-TopK ratios) calibrated for another model are refused at install, by name;
    a file of another kind, or not a safetensors file, is refused at load, naming the file."""
    from tiny_models import tiny_model

    from policyzoo import Decoder, Forecast, Threshold, TopK

    other = {f"{layer}.{t}": 0.5 for layer in range(30) for t in ("q", "k", "v", "o", "gate", "up", "down")}
    with pytest.raises(ValueError, match=r"Threshold: the thresholds do not fit this model \(2 layers.*'10.down'"):
        Decoder(tiny_model("llama"), proj=Threshold(0.5, thresholds=other))
    with pytest.raises(ValueError, match=r"TopK\(mode='fast'\): the ratios do not fit.*lacks"):
        Decoder(tiny_model("llama"), proj=TopK(0.5, mode="fast", ratios={"0.q": 1.0}))
    fits = {f"{layer}.{t}": 0.1 for layer in range(2) for t in ("q", "k", "v", "o", "gate", "up", "down")}
    Decoder(tiny_model("llama"), proj=Threshold(0.5, thresholds=fits))  # this model's own
    heads = Forecast(0.5, rank=4)
    heads.attach(tiny_model("llama"))
    path = heads.save(tmp_path / "heads.safetensors")
    with pytest.raises(ValueError, match=r"Threshold.load: .*heads.safetensors' is not a policyzoo Threshold file \(it holds 'Forecast' data"):
        Threshold.load(path)
    junk = tmp_path / "x.txt"
    junk.write_text("not tensors")
    with pytest.raises(ValueError, match=r"TopK.load: .*x.txt' is not a safetensors file"):
        TopK.load(junk)
    with pytest.raises(FileNotFoundError, match="Threshold.load: no file"):
        Threshold.load(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match=r"Forecast\(heads='.*x.txt'\): .* is not a safetensors file"):
        Forecast(heads=str(junk))

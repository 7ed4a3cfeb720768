"""Batch: columns sharing dim 0, object columns, meta; split/concat/repeat/pad round trips."""
import pickle

import pytest
import torch

from hflow import Batch


def make(n=5):
    return Batch({"ids": torch.arange(n * 3).reshape(n, 3), "score": torch.arange(n) * 0.5,
                  "text": [f"row{i}" for i in range(n)]}, meta={"temperature": 0.7})


def test_columns_and_lengths():
    b = make()
    assert len(b) == 5 and set(b.keys()) == {"ids", "score", "text"}
    assert b["text"][2] == "row2" and b["ids"].shape == (5, 3)
    assert set(b.tensors) == {"ids", "score"} and set(b.objects) == {"text"}
    b["mask"] = torch.ones(5, 3)
    assert "mask" in b
    with pytest.raises(ValueError, match="'bad' has 4 rows but column 'ids' has 5"):
        b["bad"] = torch.zeros(4)
    with pytest.raises(ValueError, match="'words' has 6 rows"):
        b["words"] = ["x"] * 6
    with pytest.raises(ValueError, match="meta"):
        b["scalar"] = torch.tensor(1.0)
    with pytest.raises(TypeError, match="meta"):
        b["temperature"] = 0.5
    with pytest.raises(KeyError, match="no column 'missing'"):
        b["missing"]
    with pytest.raises(ValueError, match="'b' has 2 rows but column 'a' has 3"):
        Batch({"a": torch.zeros(3), "b": torch.zeros(2)})


def test_row_selection():
    b = make()
    sub = b[[4, 0]]
    assert sub["text"] == ["row4", "row0"] and sub["score"].tolist() == [2.0, 0.0]
    assert b[1:3]["text"] == ["row1", "row2"] and len(b[-1]) == 1 and b[-1]["text"] == ["row4"]
    mask = b["score"] > 1.0
    assert b[mask]["text"] == ["row3", "row4"]
    assert b.meta == sub.meta == {"temperature": 0.7}
    assert set(b.select("ids", "text").keys()) == {"ids", "text"}
    assert set(b.drop("ids").keys()) == {"score", "text"}


def test_split_concat_round_trip():
    b = make(7)
    parts = b.split(3)
    assert [len(p) for p in parts] == [3, 2, 2]
    back = Batch.concat(parts)
    assert torch.equal(back["ids"], b["ids"]) and back["text"] == b["text"]
    assert back.meta == b.meta
    assert [len(p) for p in b.split([1, 6])] == [1, 6]
    with pytest.raises(ValueError, match="sum to 5"):
        b.split([1, 4])
    with pytest.raises(KeyError, match="columns"):
        Batch.concat([b.select("ids"), b.select("text")])


def test_concat_meta_that_differs_becomes_a_list():
    a, c = make(2), make(2)
    a.meta["loss"], c.meta["loss"] = 1.0, 3.0
    out = Batch.concat([a, c])
    assert out.meta == {"temperature": 0.7, "loss": [1.0, 3.0]}


def test_repeat():
    b = Batch({"x": torch.tensor([1, 2]), "s": ["a", "b"]})
    assert b.repeat(3)["x"].tolist() == [1, 1, 1, 2, 2, 2]
    assert b.repeat(3)["s"] == ["a", "a", "a", "b", "b", "b"]
    assert b.repeat(2, interleave=False)["x"].tolist() == [1, 2, 1, 2]
    assert b.repeat(2, interleave=False)["s"] == ["a", "b", "a", "b"]


def test_union():
    b = make(3)
    extra = Batch({"logp": torch.zeros(3)}, meta={"temperature": 0.7, "step": 1})
    u = b | extra
    assert set(u.keys()) == {"ids", "score", "text", "logp"} and u.meta["step"] == 1
    with pytest.raises(KeyError, match=r"\['score'\]"):
        b | Batch({"score": torch.zeros(3)})
    with pytest.raises(ValueError, match="3 rows vs 2 rows"):
        b | Batch({"y": torch.zeros(2)})
    with pytest.raises(KeyError, match="temperature"):
        b | Batch({"y": torch.zeros(3)}, meta={"temperature": 1.0})


def test_pad_unpad():
    b = make(5)
    padded, n = b.pad(4)
    assert n == 3 and len(padded) == 8
    assert padded["text"][5:] == ["row0", "row1", "row2"]      # real rows, repeated
    assert padded.unpad(n)["text"] == b["text"]
    same, zero = b.pad(5)
    assert zero == 0 and same is b
    tiny, n = make(1).pad(4)
    assert n == 3 and tiny["text"] == ["row0"] * 4


def test_to_clone_and_pickle_without_per_row_tensors():
    b = make(4)
    c = b.clone()
    c["ids"][0, 0] = 99
    assert b["ids"][0, 0] == 0
    assert b.to("cpu")["ids"].device.type == "cpu"
    state = b.__getstate__()
    # tensors are whole columns, so RPC's pickler ships each as one buffer
    assert isinstance(state["cols"]["ids"], torch.Tensor)
    back = pickle.loads(pickle.dumps(b))
    assert torch.equal(back["ids"], b["ids"]) and back["text"] == b["text"] and back.meta == b.meta


def test_padding_holds_the_pad_token_else_the_eos_else_0():
    """One convention for what padding holds, asked of a tokenizer or a model config alike."""
    from types import SimpleNamespace as NS
    from hflow.layout import pad_id
    assert pad_id(NS(pad_token_id=5, eos_token_id=2)) == 5
    assert pad_id(NS(pad_token_id=0, eos_token_id=2)) == 0          # 0 is a pad id, not "none"
    assert pad_id(NS(pad_token_id=None, eos_token_id=2)) == 2
    assert pad_id(NS(pad_token_id=None, eos_token_id=[7, 8])) == 7  # generation configs list several
    assert pad_id(NS(pad_token_id=None, eos_token_id=None)) == 0
    assert pad_id(NS()) == 0

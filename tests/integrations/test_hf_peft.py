"""Adapter-only saving (hf_peft.py) without peft installed: a model with a frozen base
and a trainable head goes through a Checkpointer; only the head is stored, restored in
place, and a resume onto another base fails naming it."""

from __future__ import annotations

import pytest
import torch

from asyncckpt import Checkpointer, CheckpointerOptions, StateMismatchError, load
from asyncckpt.integrations.hf_peft import TrainableParameters, base_reference, check_base


def frozen_base_model(hidden: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, 2))
    net[0].requires_grad_(False)  # the base
    return net


def test_only_trainable_parameters_are_saved_and_restored_in_place(inproc_writer):
    net = frozen_base_model()
    view = TrainableParameters(net)
    assert list(view.state_dict()) == ["1.weight", "1.bias"]
    assert view.state_dict()["1.weight"].data_ptr() == net[1].weight.data_ptr()  # no copy
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad])
    net(torch.ones(1, 64)).sum().backward()
    opt.step()
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    root = inproc_writer.root
    with Checkpointer(root, model=view, optimizer=opt,
                      options=CheckpointerOptions(save_interval=1),
                      address=inproc_writer.address) as ckpt:
        ckpt.save(1, extra={"peft_base": base_reference(net)}).wait()
    assert set(load(root)["model"]) == {"1.weight", "1.bias"}  # the base is not stored
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
    with Checkpointer(root, model=view, optimizer=opt, fence=False,
                      address=inproc_writer.address) as ckpt:
        assert ckpt.restore() == 1
        check_base(ckpt.extra["peft_base"], net, 1)
    assert torch.equal(net[1].weight, saved["1.weight"])
    assert not net[0].weight.any()  # the frozen base is the caller's to load, untouched


def test_a_resume_onto_another_base_fails_naming_both():
    reference = base_reference(frozen_base_model(64))
    with pytest.raises(StateMismatchError, match="frozen base") as e:
        check_base(reference, frozen_base_model(32), 7)
    assert e.value.step == 7
    check_base(reference, frozen_base_model(64), 7)  # the same base passes


def test_a_model_with_nothing_trainable_is_refused():
    net = frozen_base_model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        TrainableParameters(net)

# Copyright 2024 Bytedance Ltd. and/or its affiliates
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""verl's own checkpoint test, run through asyncckpt's drop-in on CPU (one rank of it).

Origin: https://github.com/volcengine/verl, tests/special_distributed/test_fsdp_ckpt.py
at commit b178a3cd56f58b2d502255daba591e92833930a7 (main of 2026-01-29, the newest
commit at hand; the verl 0.9.1 wheel ships no tests), Apache License 2.0, copyright
Bytedance Ltd. and/or its affiliates (notice above). A port: the test's steps, models,
optimizer, scheduler and every assertion are verl's; what differs, and why:

- The one import line a verl user changes: asyncckpt's FSDPCheckpointManager for verl's.
- CPU instead of CUDA: `verl_cpu.install()` gives verl a CPU platform (gloo, CPU RNG
  state, a "device" per rank) and a gloo-only process group; FSDP1 is given
  `device_id=cpu` (it refuses CPU without it); `unpad_input` is verl's own torch
  fallback (the original imports flash-attn's on
  CUDA); eager attention instead of flash-attention-2.
- A tiny Qwen2 from a config and a tokenizer built here (the original reads
  Qwen2.5-0.5B's tokenizer from ~/models and builds a 1-layer Qwen2 of default width),
  and a smaller batch (4 x 64 tokens instead of 10 x 1024).
- `--temp-dir` (this rank's directory instead of a new `tempfile.mkdtemp()`) and
  `--keep` (leave it in place), so that a second run saves into the first's
  directories, as a user who restarts from scratch into an old directory does.
- Added assertions: the optimizer state and the LR scheduler equal after the load what
  they were at the save (the original checks them only through the logits of the
  repeated update), and the LR of the param group with them.

    STRATEGY=fsdp|fsdp2 python verl_fsdp_ckpt.py [--temp-dir DIR] [--keep]

Environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (one process per
rank). Prints "TEMP_DIR <path>" and, at the end, "OK rank <r>".
"""

import argparse
import copy
import os
import shutil
import sys
import tempfile

import verl_cpu

verl_cpu.install()

import torch  # noqa: E402
import torch.distributed  # noqa: E402
from torch.distributed import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402
from verl.utils.device import get_device_name, get_torch_device  # noqa: E402
from verl.utils.fsdp_utils import MixedPrecisionPolicy, apply_fsdp2  # noqa: E402
from verl_cpu import initialize_global_process_group  # noqa: E402  (gloo alone on CPU)

from asyncckpt.integrations.verl import FSDPCheckpointManager  # noqa: E402  (the one line)


def create_random_input_ids(batch_size, seq_len, vocab_size):
    if get_device_name() == "cuda":
        from flash_attn.bert_padding import unpad_input
    else:  # npu, and cpu here: verl's own (a torch fallback without flash-attn)
        from verl.utils.attention_utils import unpad_input
    from verl.utils.model import compute_position_id_with_mask, create_random_mask

    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), device=get_device_name())

    attention_mask = create_random_mask(
        input_ids, max_ratio_of_left_padding=0.1, min_ratio_of_valid_token=0.5,
        max_ratio_of_valid_token=0.7
    )
    position_ids = compute_position_id_with_mask(attention_mask)

    input_ids = unpad_input(input_ids.unsqueeze(-1), attention_mask)[0].transpose(0, 1)
    position_ids = unpad_input(position_ids.unsqueeze(-1), attention_mask)[0].transpose(0, 1)
    return input_ids, position_ids


def tiny_tokenizer():
    """A word-level tokenizer built here (the original loads Qwen2.5-0.5B's from disk)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(40)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def full_optimizer_state(model, optimizer):
    """Added: the whole optimizer state on every rank (a copy), to compare after the load."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer,
                                     options=StateDictOptions(full_state_dict=True))
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, state)


def full_model_state(model):
    """Added: the whole model state on every rank (a copy). verl's own check compares
    `model.state_dict()` before and after the load, which under FSDP2 are the very
    parameters the load fills in place: it cannot fail there."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, state)


def assert_same(a, b, path="optimizer"):
    """Added: `a` and `b` equal bit for bit (tensors) or by value (everything else)."""
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0, msg=f"{path} differs")
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(set(a) ^ set(b), key=str)[:5]}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_fsdp_ckpt(strategy="fsdp", temp_dir=None, keep=False):
    assert get_torch_device().device_count() >= 2, "need at least 2 gpus for test"
    local_rank, rank, world_size = initialize_global_process_group()
    device_mesh = init_device_mesh(get_device_name(), mesh_shape=(world_size,),
                                   mesh_dim_names=("dp",))

    config = Qwen2Config(
        num_hidden_layers=1, vocab_size=512, hidden_size=64, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )

    with torch.device(get_device_name()):
        model = AutoModelForCausalLM.from_config(config=config, torch_dtype=torch.bfloat16,
                                                 attn_implementation="eager")
        model = model.to(device=get_device_name())

    # Wrap model with FSDP
    if strategy == "fsdp":
        mixed_precision = MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32
        )

        model = FSDP(
            model,
            use_orig_params=False,
            device_id=torch.device("cpu"),  # CUDA: get_torch_device().current_device()
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            mixed_precision=mixed_precision,
            device_mesh=device_mesh,
        )
    else:
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
        )
        fsdp_kwargs = {
            "mesh": device_mesh,
            "mp_policy": mp_policy,
        }
        apply_fsdp2(model, fsdp_kwargs, {})

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)

    # Create checkpoint manager
    tokenizer = tiny_tokenizer()
    checkpoint_manager = FSDPCheckpointManager(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, tokenizer=tokenizer
    )

    # Generate sample input
    batch_size = 4
    seq_len = 64
    vocab_size = config.vocab_size
    # First input for initial update
    input_ids1, position_ids1 = create_random_input_ids(batch_size, seq_len, vocab_size)

    # Second input for verification
    input_ids2, position_ids2 = create_random_input_ids(batch_size, seq_len, vocab_size)

    # Step 1: Initial update and save checkpoint
    outputs1 = model(input_ids=input_ids1, position_ids=position_ids1)
    loss1 = outputs1.logits.mean()
    loss1.backward()
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad()

    # Save checkpoint after first update
    temp_dir = temp_dir or tempfile.mkdtemp()
    print(f"TEMP_DIR {temp_dir}", flush=True)
    checkpoint_path = os.path.join(temp_dir, "checkpoint")
    checkpoint_manager.save_checkpoint(local_path=checkpoint_path, hdfs_path=None, global_step=0)
    saved_state_dict = model.state_dict()
    saved_model = full_model_state(model)  # added
    saved_optimizer = full_optimizer_state(model, optimizer)  # added
    saved_scheduler = copy.deepcopy(lr_scheduler.state_dict())  # added
    saved_lr = optimizer.param_groups[0]["lr"]  # added

    # Step 2: Second update and forward pass
    outputs2 = model(input_ids=input_ids2, position_ids=position_ids2)
    loss2 = outputs2.logits.mean()
    loss2.backward()
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad()

    # Record logits after second update
    with torch.no_grad():
        logits_before_load = model(input_ids=input_ids2, position_ids=position_ids2).logits

    # Step 3: Load checkpoint and repeat second update
    moved = full_model_state(model)  # added: the second update changed the weights
    assert any(not torch.equal(moved[k], saved_model[k]) for k in saved_model)  # added
    checkpoint_manager.load_checkpoint(checkpoint_path)
    assert_same(full_model_state(model), saved_model, "model")  # added
    loaded_state_dict = model.state_dict()
    for key in loaded_state_dict:
        assert key in saved_state_dict, f"Key {key} not found in saved state dict"
        torch.testing.assert_close(loaded_state_dict[key], saved_state_dict[key], atol=0.0,
                                   rtol=0.0)
    assert_same(full_optimizer_state(model, optimizer), saved_optimizer)  # added
    assert lr_scheduler.state_dict() == saved_scheduler  # added
    assert optimizer.param_groups[0]["lr"] == saved_lr  # added

    # Repeat the second update with same input
    outputs3 = model(input_ids=input_ids2, position_ids=position_ids2)
    loss3 = outputs3.logits.mean()
    loss3.backward()
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad()

    # Record logits after loaded checkpoint and update
    with torch.no_grad():
        logits_after_load = model(input_ids=input_ids2, position_ids=position_ids2).logits

    # Step 4: Verify outputs match
    torch.testing.assert_close(logits_before_load, logits_after_load, atol=0.0, rtol=0.0)
    print("Checkpoint save/load test passed!")

    # Cleanup
    if not keep:
        shutil.rmtree(temp_dir)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    print(f"OK rank {rank}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--temp-dir", help="this rank's directory (default: tempfile.mkdtemp())")
    parser.add_argument("--keep", action="store_true", help="leave the directory in place")
    args = parser.parse_args()
    strategy = os.environ.get("STRATEGY", "fsdp")
    os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"
    test_fsdp_ckpt(strategy=strategy, temp_dir=args.temp_dir, keep=args.keep)
    sys.stdout.flush()

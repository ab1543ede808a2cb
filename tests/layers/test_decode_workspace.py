"""The CPU decode workspace (rows sorted by length, holes, re-sorts, reloads) must attend
exactly as the paged-cache reference does, step after step, as sequences come and go."""

import random
from types import SimpleNamespace

import torch

from shoal.kernels import reference as ref
from shoal.runtime.engine.step_input import pad_rows
from shoal.runtime.layers.decode_workspace import DecodeRows, decode_attention, new_workspace, read_cost

BS, KVH, H, D, BLOCKS = 4, 2, 6, 16, 2000


def test_workspace_attention_matches_paged_reference_as_sequences_come_and_go():
    rng = random.Random(0)
    torch.manual_seed(0)
    kv = torch.randn(2, KVH, BLOCKS, BS, D).permute(0, 2, 3, 1, 4)  # the engine's layout
    k_cache, v_cache = kv[0], kv[1]
    free_blocks = list(range(BLOCKS))
    planner = DecodeRows(10**9, 2 * KVH * D * 4, KVH)
    workspace, live, next_id, resorts, holes = None, [], 0, 0, 0
    for step in range(60):
        if step % 5 == 0 or not live:  # arrivals with prompts of any length
            for _ in range(rng.randint(1, 4)):
                n = rng.randint(1, 40)
                table = [free_blocks.pop() for _ in range(-(-(n + 80) // BS))]
                live.append(SimpleNamespace(seq_id=next_id, num_computed=n, block_table=table))
                next_id += 1
        if rng.random() < 0.3 and len(live) > 1:  # a sequence finishes
            free_blocks.extend(live.pop(rng.randrange(len(live))).block_table)
        batch = SimpleNamespace(seqs=list(live), num_decodes=len(live))
        plan = planner.plan(batch, pad_rows)
        if plan.reset or workspace is None:
            workspace = new_workspace(plan, KVH, D, torch.float32, "cpu")
        resorts += plan.decode_rows is None
        holes += plan.used_rows > len(live)
        decodes = batch.seqs
        q, k, v = torch.randn(len(decodes), H, D), torch.randn(len(decodes), KVH, D), torch.randn(len(decodes), KVH, D)
        slots = torch.tensor([s.block_table[s.num_computed // BS] * BS + s.num_computed % BS for s in decodes])
        ref.write_kv_cache(k, v, k_cache, v_cache, slots)
        got = decode_attention(q, k, v, k_cache, v_cache, workspace, plan, D**-0.5)
        lens = torch.tensor([s.num_computed + 1 for s in decodes])
        want = ref.paged_attention_decode(q, k_cache, v_cache, pad_rows([s.block_table for s in decodes]), lens, D**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for s in decodes:
            s.num_computed += 1
    assert holes > 0 and resorts > 0  # both layouts were exercised


def test_sorted_rows_read_less_than_padding_to_the_longest():
    lens = [700, 650, 400, 390, 380, 200, 100, 90, 60, 50, 40, 30, 20, 10, 5, 1]
    assert read_cost(lens) < 0.75 * len(lens) * max(lens)


def test_workspace_attention_runs_in_half_precision():
    torch.manual_seed(0)
    kv = torch.randn(2, KVH, 64, BS, D).permute(0, 2, 3, 1, 4)
    k_cache, v_cache = kv[0], kv[1]
    live = [SimpleNamespace(seq_id=i, num_computed=n, block_table=list(range(i * 16, i * 16 + 16))) for i, n in enumerate((5, 30, 17))]
    batch = SimpleNamespace(seqs=live, num_decodes=len(live))
    plan = DecodeRows(10**9, 2 * KVH * D * 2, KVH).plan(batch, pad_rows)
    q, k, v = torch.randn(3, H, D), torch.randn(3, KVH, D), torch.randn(3, KVH, D)
    slots = torch.tensor([s.block_table[s.num_computed // BS] * BS + s.num_computed % BS for s in live])
    ref.write_kv_cache(k, v, k_cache, v_cache, slots)
    want = ref.paged_attention_decode(q, k_cache, v_cache, pad_rows([s.block_table for s in live]), torch.tensor([s.num_computed + 1 for s in live]), D**-0.5)
    bf = torch.bfloat16
    workspace = new_workspace(plan, KVH, D, bf, "cpu")
    got = decode_attention(q.to(bf), k.to(bf), v.to(bf), k_cache.to(bf), v_cache.to(bf), workspace, plan, D**-0.5)
    assert got.dtype == bf
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)

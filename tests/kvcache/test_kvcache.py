"""CacheManager: block accounting (allocate / append / fork / free / drop_front), reservations,
copy-on-write storage, and no leaked block after 1,000 mixed random requests."""

from __future__ import annotations

import random

import pytest
import torch

from omniloop_kvcache import CacheFull, CacheManager, KVHandle, KVLayout, padded_slot_table


def test_allocate_append_free_accounting() -> None:
    m = CacheManager(block_size=4, num_blocks=10)
    h = m.allocate(6)
    assert m.used_blocks == 2 and m.length(h) == 0
    s = m.append(h, 6)
    assert s.tolist() == [b * 4 + o for b, o in zip([0, 0, 0, 0, 1, 1], [0, 1, 2, 3, 0, 1], strict=True)]
    assert m.used_blocks == 2 and m.length(h) == 6
    m.append(h, 3)  # 9 tokens -> 3 blocks
    assert m.used_blocks == 3 and len(m.block_table(h)) == 3
    m.check()
    m.free(h)
    m.free(h)  # idempotent
    assert m.used_blocks == 0 and m.free_blocks == 10 and m.sequences == 0
    m.check()
    with pytest.raises(ValueError, match="freed"):
        m.append(h, 1)


def test_reservation_counts_for_admission_and_is_returned() -> None:
    m = CacheManager(block_size=4, num_blocks=10)
    h = m.allocate(4, reserve_tokens=20)  # 1 block now, 5 reserved in total
    assert m.used_blocks == 1 and m.reserved_blocks == 4 and m.free_blocks == 5
    assert m.can_allocate(20) and not m.can_allocate(21)
    with pytest.raises(CacheFull, match="6 blocks needed"):
        m.allocate(reserve_tokens=24)
    m.append(h, 12)  # 3 blocks, drawn from the reservation
    assert m.used_blocks == 3 and m.reserved_blocks == 2 and m.free_blocks == 5
    m.free(h)
    assert m.free_blocks == 10 and m.reserved_blocks == 0
    m.check()


def test_append_beyond_capacity_raises_cache_full() -> None:
    m = CacheManager(block_size=2, num_blocks=2)
    h = m.allocate()
    m.append(h, 4)
    with pytest.raises(CacheFull):
        m.append(h, 1)
    m.check()


def test_fork_shares_blocks_and_copies_on_write() -> None:
    lay = KVLayout(layers=2, kv_heads=1, head_dim=2)
    m = CacheManager(lay, block_size=4, num_blocks=8)
    a = m.allocate()
    sa = m.append(a, 6)
    for layer in range(2):
        kv = torch.arange(12.0).reshape(6, 1, 2) + 100 * layer
        m.write(layer, sa, kv, -kv)
    b = m.fork(a)
    assert m.block_table(a) == m.block_table(b) and m.used_blocks == 2
    sb = m.append(b, 1)  # the shared half-full block is copied before b writes into it
    assert m.block_table(b)[0] == m.block_table(a)[0] and m.block_table(b)[1] != m.block_table(a)[1]
    assert m.used_blocks == 3
    m.write(0, sb, torch.full((1, 1, 2), 7.0), torch.full((1, 1, 2), 7.0))
    ka, _ = m.gather(0, m.slots(a))
    kb, vb = m.gather(0, m.slots(b))
    assert torch.equal(kb[:6], ka) and torch.equal(kb[6], torch.full((1, 2), 7.0))
    assert torch.equal(vb[:6], -ka)
    k1, _ = m.gather(1, m.slots(b))
    assert torch.equal(k1[:6], torch.arange(12.0).reshape(6, 1, 2) + 100)
    m.free(a)
    assert m.used_blocks == 2  # b still holds the shared first block and its own copy
    m.free(b)
    assert m.used_blocks == 0
    m.check()


def test_drop_front_recycles_out_of_window_blocks() -> None:
    m = CacheManager(block_size=4, num_blocks=4)
    h = m.allocate()
    m.append(h, 10)
    m.drop_front(h, 2)
    assert m.used_blocks == 1 and m.start(h) == 8 and m.length(h) == 10
    assert len(m.slots(h)) == 2
    m.append(h, 6)  # positions keep counting, recycled blocks are reused
    assert m.length(h) == 16 and m.used_blocks == 2
    with pytest.raises(ValueError, match="full blocks"):
        m.drop_front(h, 3)
    m.free(h)
    m.check()


def test_budget_sizes_the_pool_and_foreign_handles_are_refused() -> None:
    lay = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
    assert lay.bytes_per_token == 2 * 2 * 2 * 8 * 4
    m = CacheManager(lay, block_size=16, budget_bytes=lay.bytes_per_token * 16 * 5 + 7)
    assert m.num_blocks == 5 and m.capacity_bytes == lay.bytes_per_token * 80
    assert m.k[0].shape == (80, 2, 8)
    other = CacheManager(block_size=4, num_blocks=2)
    with pytest.raises(ValueError, match="does not belong"):
        m.free(other.allocate())
    with pytest.raises(ValueError, match="exactly one"):
        CacheManager(block_size=4)
    with pytest.raises(ValueError, match="holds no block"):
        CacheManager(lay, budget_bytes=10)
    with pytest.raises(ValueError, match="head_dim"):
        KVLayout(layers=1, kv_heads=1, head_dim=0)


def test_padded_slot_table() -> None:
    t = padded_slot_table([torch.tensor([3, 4]), torch.tensor([9])], pad=0)
    assert t.tolist() == [[3, 4], [9, 0]]


def test_batched_slot_table_equals_per_sequence_slots() -> None:
    m = CacheManager(block_size=4, num_blocks=16)
    hs = [m.allocate() for _ in range(3)]
    for h, n in zip(hs, (9, 1, 14), strict=True):
        m.append(h, n)
    m.drop_front(hs[2], 2)
    table, lengths = m.slot_table(hs, pad=-1)
    assert lengths.tolist() == [9, 1, 6]
    for row, h, n in zip(table, hs, lengths.tolist(), strict=True):
        assert torch.equal(row[:n], m.slots(h)) and (row[n:] == -1).all()


def test_no_leaked_blocks_after_1000_mixed_random_requests() -> None:
    rng = random.Random(0)
    m = CacheManager(block_size=8, num_blocks=256)
    live: list[KVHandle] = []
    done = refused = forks = drops = 0
    while done < 1000:
        op = rng.random()
        if op < 0.35 or not live:
            prompt, reserve = rng.randint(0, 40), rng.randint(0, 120)
            try:
                h = m.allocate(prompt, reserve_tokens=max(prompt, reserve))
            except CacheFull:
                refused += 1
                h = None
            if h is not None:
                m.append(h, prompt)
                live.append(h)
        elif op < 0.65:
            h = rng.choice(live)
            try:
                m.append(h, rng.randint(1, 12))
            except CacheFull:
                pass
        elif op < 0.75:
            try:
                live.append(m.fork(rng.choice(live), reserve_tokens=rng.randint(0, 16)))
                forks += 1
            except CacheFull:
                refused += 1
        elif op < 0.8:
            h = rng.choice(live)
            held = m.length(h) - m.start(h)
            if held >= 8:
                m.drop_front(h, rng.randint(0, held // 8))
                drops += 1
        else:
            h = live.pop(rng.randrange(len(live)))
            m.free(h)
            done += 1
        if rng.random() < 0.05:
            m.check()
    for h in live:
        m.free(h)
    m.check()
    assert forks > 50 and drops > 10 and refused > 0
    assert m.used_blocks == 0 and m.reserved_blocks == 0 and m.free_blocks == m.num_blocks and m.sequences == 0


def test_chunk_kv_slabs_with_a_sink_and_a_local_window() -> None:
    """Causal video's use: one block per latent chunk (a slab), the first chunk kept as a sink,
    a window of two more; memory stays bounded however long the rollout runs."""
    chunk = 6  # tokens per latent chunk
    lay = KVLayout(layers=1, kv_heads=1, head_dim=1)
    m = CacheManager(lay, block_size=chunk, num_blocks=4, name="chunk-kv")
    h = m.allocate(reserve_tokens=3 * chunk)
    for i in range(10):
        if i >= 3:  # the window is full: recycle the oldest chunk after the sink
            m.drop_front(h, 1, keep=1)
        slots = m.append(h, chunk)
        m.write(0, slots, torch.full((chunk, 1, 1), float(i)), torch.full((chunk, 1, 1), float(i)))
        assert m.used_blocks == min(i + 1, 3)
    k, _ = m.gather(0, m.slots(h))
    assert k.flatten().tolist() == [0.0] * chunk + [8.0] * chunk + [9.0] * chunk
    assert m.positions(h).tolist() == [*range(0, 6), *range(48, 60)]
    assert m.length(h) == 60
    with pytest.raises(ValueError, match="keeps 1 sink blocks"):
        m.drop_front(h, 1, keep=0)
    m.free(h)
    assert m.used_blocks == 0 and m.reserved_blocks == 0
    m.check()

"""Cost contract of document packing and loss reduction: op count flat in the number of rows/documents,
a fixed number of host syncs (pack_documents: 1, the document count riding on the plan's own sync;
losses: 0 with on_empty='skip', 1 with on_empty='raise')."""

from __future__ import annotations

import torch

from verl_cppack import ParallelContext
from verl_cppack.bench.counters import HostReadCounter, OpCounter
from verl_cppack.loss import document_mean_loss, token_mean_loss
from verl_cppack.packing.documents import pack_documents

PAD, EOD = 0, 1


def token_batch(batch_size: int, seq_len: int = 32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 100, (batch_size, seq_len), generator=generator)
    tokens[torch.rand(batch_size, seq_len, generator=generator) < 0.1] = EOD
    tokens[torch.rand(batch_size, seq_len, generator=generator) < 0.1] = PAD
    return tokens


def costs(batch_size: int, ctx: ParallelContext) -> dict[str, tuple[int, int]]:
    tokens = token_batch(batch_size)
    result = {}
    with OpCounter() as counter, HostReadCounter() as tolist:
        docs = pack_documents(tokens, eod_id=EOD, pad_id=PAD, ctx=ctx, mtp_depth=2)
    result["pack"] = (counter.total_ops, counter.syncs() + tolist.calls)
    losses = docs.tokens.double()
    for name, reduce in (
        ("token_skip", lambda: token_mean_loss(losses, docs.loss_mask, on_empty="skip")),
        ("token_raise", lambda: token_mean_loss(losses, docs.loss_mask)),
        (
            "document_skip",
            lambda: document_mean_loss(losses, docs.loss_mask, docs.document_ids, docs.num_documents, on_empty="skip"),
        ),
    ):
        with OpCounter() as counter, HostReadCounter() as tolist:
            reduce()
        result[name] = (counter.total_ops, counter.syncs() + tolist.calls)
    return result


def test_op_count_is_flat_in_the_number_of_rows_and_documents():
    for ctx in (ParallelContext(), ParallelContext(cp_size=2, cp_rank=1)):
        small, large = costs(4, ctx), costs(256, ctx)
        assert small == large
        assert small["pack"][1] == 1
        assert small["token_skip"][1] == 0 and small["token_raise"][1] == 1 and small["document_skip"][1] == 0

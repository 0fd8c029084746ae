"""What the engine's tests share: a tiny random-initialised Llama target (`tiny`), drafters over it from untrained
to trained (`drafters`), and proposers whose drafts the test controls (`ReferenceProposer`, `OracleProposer`).
Import the fixtures by name into a test module (module scope: built once per module)."""
import pytest
import torch

from conftest import make_tiny_hf, ragged_prompts
from flexdraft.core.config import RuntimeConfig
from flexdraft.drafter.model import Drafter, DrafterConfig
from flexdraft.engine.ar import generate
from flexdraft.engine.engine import Engine
from flexdraft.engine.proposers import DrafterProposer
from flexdraft.models.loading import load_model
from flexdraft.speculative.sampling import SamplingParams
from flexdraft.training.drafter_training import Sequences, training_step

CPU32 = RuntimeConfig(device="cpu", dtype="float32", threads=1, cpu_prepack=False)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny target as a HF folder (`transformers` loads it as the independent reference)."""
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_hf("llama", folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_model(tiny_folder, CPU32, with_tokenizer=False).model



@pytest.fixture(scope="module")
def drafters(tiny):
    """untrained (copied projectors, calibration zero); random (projectors and calibration perturbed), also
    with blocks entering at layer 1 and causal tuned attention; trained (60 attention-tuning steps on the
    tiny target's own greedy continuations, then calibration)."""
    torch.manual_seed(0)
    cfg = DrafterConfig(k=2, block_size=4)
    untrained = Drafter.from_target(tiny, cfg)
    random = Drafter.from_target(tiny, cfg)
    entry1 = Drafter.from_target(tiny, DrafterConfig(k=2, block_size=4, entry_layer=1, tuned_attention="causal"))
    with torch.no_grad():
        for p in (*random.parameters(), *entry1.parameters()):
            p.add_(torch.randn_like(p) * 0.5)
    trained = Drafter.from_target(tiny, cfg)
    prompts = ragged_prompts(16, seed=7)
    outs = generate(tiny, prompts, SamplingParams(max_new_tokens=40))
    rows = [p + o.token_ids for p, o in zip(prompts, outs)]
    T = max(map(len, rows))
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    seqs = Sequences(tokens, torch.tensor([len(r) for r in rows]), torch.tensor([len(p) for p in prompts]))
    g = torch.Generator().manual_seed(0)
    for stage, steps in (("attention", 60), ("calibration", 30)):
        opt = torch.optim.AdamW(trained.parameters_for(stage), lr=3e-3)
        for _ in range(steps):
            opt.zero_grad()
            training_step(trained, tiny, seqs, stage, 16, "ce", 0.8, g).loss.backward()
            opt.step()
    trained.requires_grad_(False)
    return {name: d.to_runtime(tiny) for name, d in
            {"untrained": untrained, "random": random, "random-entry1-causal": entry1, "trained": trained}.items()}


def tiny_vocabulary(folder):
    """A 12-token llama (enumerable distributions) and a random drafter of blocks of 2 whose q is far from p."""
    make_tiny_hf("llama", folder, vocab_size=12, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = load_model(folder, CPU32, with_tokenizer=False).model
    torch.manual_seed(0)
    drafter = Drafter.from_target(model, DrafterConfig(k=2, block_size=2))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model, drafter.to_runtime(model)


class ReferenceProposer(DrafterProposer):
    """The engine's drafter proposer whose drafts, each time it writes them, are replaced (`replace`) by ones made
    from the reference continuation of the row's request: drafts the test controls, through the proposer's
    interface."""

    def __init__(self, engine: Engine, reference: dict):
        p = engine.proposer
        super().__init__(p.target, p.drafter, p.cache, p.state, p.trees, p.timed)
        self.B, self.reference = engine.B, reference

    def write(self, rows, logits, slots, batch, confidences, from_branch=False):
        super().write(rows, logits, slots, batch, confidences, from_branch)
        for row in rows.tolist():
            req = slots[row]
            ref = torch.tensor((self.reference[tuple(req.prompt)][len(req.tokens):] + [0] * self.B)[: self.B])
            self.replace(row, ref, self.target.args.vocab_size, self.state.cand.shape[-1])


class OracleProposer(ReferenceProposer):
    """Drafts = the reference continuation (always right) or a token that differs from it (always wrong), with
    full confidence: verification alone must keep the output exact."""

    def __init__(self, engine: Engine, reference: dict, wrong: bool):
        super().__init__(engine, reference)
        self.wrong = wrong

    def replace(self, row, ref, V, K):
        drafts = ref + (1 if self.wrong else 0)
        self.state.drafts[row, : self.B] = drafts % V
        self.state.conf[row, : self.B] = 1.0
        # tree candidates: the draft first, then tokens that are never right
        self.state.cand[row, : self.B] = (drafts[:, None] + torch.arange(K) * (2 if self.wrong else 1)) % V
        self.state.cand_logp[row, : self.B] = -torch.arange(K, dtype=torch.float32)

"""Secure aggregation with Flower's SecAgg+ (`pocketlora federate --secagg`): the server learns each round's
weighted sum of the devices' tensors, never one device's own.

Flower's pieces, not hand-written ones:

- the device: `flwr.client.mod.secaggplus_mod` (flwr/client/mod/secure_aggregation/secaggplus_mod.py), put in front
  of the ClientApp's train function by `secagg_mod`, which hands it only the train messages that carry SecAgg+'s
  config record ("secaggplus_configs"; the mod raises on any other train message). Four stages, each a train
  message: setup (key pairs), share_keys (Shamir shares of its mask seed and key to its neighbours, encrypted),
  collect_masked_vectors (the mod calls our train function, reads its reply as a legacy FitRes, and sends the
  quantized, weighted and masked vector instead; `_collect_masked_vectors`), unmask (shares that remove the masks).
- the server: `flwr.server.workflow.SecAggPlusWorkflow` (flwr/server/workflow/secure_aggregation/
  secaggplus_workflow.py) in a `LegacyContext` (flwr/server/compat/legacy_context.py) holding Flower's legacy FedAvg
  (flwr.server.strategy.FedAvg) and a SimpleClientManager with one GridClientProxy per device, as DefaultWorkflow
  sets them up (flwr/server/workflow/default_workflows.py, flwr/server/compat/app_utils.py): the global tensors in
  context.state.array_records["parameters"] (MAIN_PARAMS_RECORD), {"current_round": r} in
  context.state.config_records["config"] (MAIN_CONFIGS_RECORD). `secure_round` drives ONE round of it; the round
  loop stays apps.server_loop's (it persists after every round and resumes after a kill).

The legacy plumbing. The workflow's setup stage turns the global ArrayRecord into legacy Parameters (names dropped,
order kept: `arrayrecord_to_parameters`) and asks the strategy's `configure_fit` for FitIns; at
collect_masked_vectors each device receives `fitins_to_recorddict(...)`: "fitins.parameters" (ArrayRecord keyed
"0", "1", ...) and "fitins.config" (our round, out, settings, and a digest of the tensor names in the order they
were sent: the manifest's trainable names, or B's for FFA-LoRA). The device maps them back by that order and
answers in `fitres_to_recorddict` form ("fitres.parameters", "fitres.num_examples", "fitres.metrics",
"fitres.status"), which the mod reads with `recorddict_to_fitres`; it then clears the reply's ArrayRecords and adds
the masked vector. The unmask stage puts the dequantized weighted mean into every FitRes and calls
`strategy.aggregate_fit` (our FedAvg subclass: Flower's FedAvg over identical vectors, i.e. the mean itself).

What the server still sees, per device: its FitRes.num_examples (our weight: the label tokens it trained on this
round; Flower's SecAgg+ sends it in the clear beside the masked vector) and FitRes.metrics, which we limit to
{device, declined, reason, gate} (the battery gate's decision). Not its tensors, and not its loss: the loss rides in
the masked vector as one more value, so only the token-weighted mean loss comes out, as without SecAgg.
A round in which a single device trained is the sum of one: the aggregate is that device's (quantized) tensors.

The arithmetic (secaggplus_mod._collect_masked_vectors, quantization.quantize, SecAggPlusWorkflow.unmask_stage):
device i with weight w_i sends u_i = SR((x_i * dq_i + C) * T / 2C) where dq_i = round(w_i / M * T) / T,
C = --secagg-clip, T = quantization_range (2**22), M = max_weight and SR stochastic rounding; the server gets
sum(u_i) mod 2**32 (masks cancel), subtracts k*C after dequantizing and divides by sum(dq_i):
sum(dq_i x_i) / sum(dq_i). M is a power of two >= the most label tokens a device can train on in a round
(local_steps x micro_batch x accum x seq_len) and C a power of two, so dq_i = w_i / M exactly (no weight
quantization) and the mean is the token-weighted FedAvg up to the values' own quantization: per device less than
2 steps of 2C/T (< 1 from stochastic rounding, < 0.4 from the float32 arithmetic of `quantize` near 2**21), so

    |secure - fedavg| <= 2 * (2C/T) * k * M / sum(w_i)     per element (k: devices with w_i > 0)

(`error_bound`, recorded per round). It grows as M / mean(w): max_weight is a bound, and short examples stay far
below it; --secagg-clip trades range for precision. Every value a device sends must lie in [-C, C] (else the mod
would clip it silently): the device checks and fails the round loudly instead.

A declined device (battery gate) must still take part in every stage (it holds shares of the others' secrets). It
answers with zeros and num_examples 0: dq = 0, its vector is (0 + C) * T/2C = T/2 exactly (C and T powers of two:
no rounding, and SR of an integer is that integer), which dequantizes to 0 + C and is cancelled exactly by the
workflow's offset -(k_active - 1) * C; its weight adds 0 to sum(dq). So a declined device changes nothing, exactly,
as without SecAgg. A round in which every device declines sums to weight 0: not released (the global stays).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import FedAvg
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key as WorkflowKey

QUANTIZATION_RANGE = 2 ** 22        # Flower's default (T)
MODULUS_RANGE = 2 ** 32             # Flower's default: k * T < 2**32 for up to 1023 devices
LOSS_RANGE = 64.0                   # the loss rides as min(loss, 64) * C / 64 (a cross-entropy above 64 nats: clamped)
STAGES = ("setup", "share_keys", "collect_masked_vectors", "unmask")
FITINS_CONFIG = "fitins.config"


# -- settings -------------------------------------------------------------------------------------------

def shares(cfg) -> int:
    return cfg.secagg_shares or cfg.devices


def threshold(cfg) -> int:
    return cfg.secagg_threshold or shares(cfg) // 2 + 1


def max_weight(cfg, manifest) -> int:
    """The smallest power of two >= the most label tokens one device can train on in a round."""
    return 1 << max(0, math.ceil(math.log2(cfg.local_steps * cfg.micro_batch * cfg.accum * manifest.seq_len)))


def is_power_of_two(x: float) -> bool:
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


def names_digest(names: list[str]) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


# -- the device ------------------------------------------------------------------------------------------

def secagg_mod(msg: Message, ctxt: Context, call_next) -> Message:
    """Flower's secaggplus_mod, for the train messages of a SecAgg+ round only (they carry its config record);
    any other message goes straight to the app."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


def is_fit_request(msg: Message) -> bool:
    return FITINS_CONFIG in msg.content.config_records


def fit_request(msg: Message, names: list[str]) -> tuple[dict, dict[str, np.ndarray]]:
    """(the FitIns config, the global tensors by name) of a SecAgg+ train request: the legacy Parameters carry no
    names, so they are mapped by the order the server sent (checked by the names' digest)."""
    ins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    conf = dict(ins.config)
    tensors = parameters_to_ndarrays(ins.parameters)
    if conf.get("names") != names_digest(names) or len(tensors) != len(names):
        raise RuntimeError(f"SecAgg+: the server sent {len(tensors)} tensors, not this device's {len(names)} in "
                           "its order (the bundle's trainable names; FFA-LoRA: B's)")
    return conf, dict(zip(names, tensors))


def vector(names: list[str], tensors: dict[str, np.ndarray], loss: float, clip: float) -> list[np.ndarray]:
    """What the device puts into its masked vector: its tensors in the sent order, then the loss scaled into
    [0, clip]. Every value must lie within [-clip, clip] and be finite, or SecAgg+'s quantization would clip (or
    garble) it without a word: the device refuses instead."""
    arrays = [np.ascontiguousarray(tensors[n], dtype=np.float32) for n in names]
    for n, a in zip(names, arrays):
        if not np.all(np.isfinite(a)):
            raise RuntimeError(f"SecAgg+: {n} holds non-finite values")
        if a.size and float(np.max(np.abs(a))) > clip:
            raise RuntimeError(f"SecAgg+: {n} has a value {float(np.max(np.abs(a))):.4g} outside "
                               f"--secagg-clip {clip:g}; rerun with a larger --secagg-clip (a power of 2)")
    if not math.isfinite(loss):
        raise RuntimeError(f"SecAgg+: the local loss is {loss}")
    return arrays + [np.array([min(max(loss, 0.0), LOSS_RANGE) * clip / LOSS_RANGE], dtype=np.float32)]


def zeros(names: list[str], tensors: dict[str, np.ndarray]) -> list[np.ndarray]:
    """A declined device's vector: zeros of the same shapes (with weight 0: contributes exactly nothing)."""
    return [np.zeros(np.shape(tensors[n]), dtype=np.float32) for n in names] + [np.zeros(1, dtype=np.float32)]


def fit_reply(msg: Message, arrays: list[np.ndarray], num_examples: int, metrics: dict) -> Message:
    res = FitRes(status=Status(code=Code.OK, message="ok"), parameters=ndarrays_to_parameters(arrays),
                 num_examples=int(num_examples), metrics=metrics)
    return Message(compat.fitres_to_recorddict(res, keep_input=True), reply_to=msg)


# -- the server ------------------------------------------------------------------------------------------

class _CountingGrid:
    """The Grid as the workflow sees it: the same, plus the bytes of every stage's messages and the nodes that
    answered with an error or not at all."""

    def __init__(self, grid):
        self.grid = grid
        self.stages: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        down = sum(_bytes(m.content) for m in messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        answered = {r.metadata.src_node_id for r in replies}
        self.stages.append({
            "down": down, "up": sum(_bytes(r.content) for r in replies if r.has_content()),
            "answered": sum(1 for r in replies if not r.has_error()),
            "errors": [(r.metadata.src_node_id, str(r.error.reason)) for r in replies if r.has_error()],
            "missing": sorted(m.metadata.dst_node_id for m in messages if m.metadata.dst_node_id not in answered)})
        return replies


def _bytes(content: RecordDict) -> int:
    """The payload of a message: array bytes and names, config and metric values (8 bytes a number, as
    ConfigRecord.count_bytes counts them; that one fails on an empty list, which the unmask stage sends)."""
    def size(v) -> int:
        if isinstance(v, (bytes, str)):
            return len(v)
        if isinstance(v, list):
            return sum(size(x) for x in v)
        return 1 if isinstance(v, bool) else 8

    total = 0
    for record in content.values():
        if isinstance(record, ArrayRecord):
            total += record.count_bytes()
        else:
            total += sum(len(k) + size(v) for k, v in record.items())
    return int(total)


class _SecureFedAvg(FedAvg):
    """Flower's legacy FedAvg, weighted by num_examples, for SecAggPlusWorkflow. By the time aggregate_fit runs,
    every FitRes holds the same vector (the securely aggregated mean), so FedAvg returns it; what the server saw
    of each device (num_examples, metrics) is kept for the round's record."""

    def __init__(self, n: int, fit_config: dict):
        super().__init__(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_evaluate_clients=0,
                         min_available_clients=n, on_fit_config_fn=lambda _: dict(fit_config),
                         fit_metrics_aggregation_fn=lambda _: {}, accept_failures=True)
        self.seen: list[tuple[int, dict]] | None = None
        self.mean: list[np.ndarray] | None = None

    def aggregate_fit(self, server_round, results, failures):
        self.seen = [(int(res.num_examples), dict(res.metrics)) for _, res in results]
        if sum(n for n, _ in self.seen) <= 0:     # every device declined: a zero-weight sum is no mean
            return None, {}
        params, metrics = super().aggregate_fit(server_round, results, failures)
        if params is not None:
            self.mean = parameters_to_ndarrays(params)
        return params, metrics


@dataclass
class SecureRound:
    released: dict[str, np.ndarray] | None      # the new values of the sent tensors (None: not released)
    record: dict = field(default_factory=dict)  # the round record's fields the server can honestly fill


def secure_round(grid, context: Context, cfg, manifest, rnd: int, nodes: list[int], sent: dict[str, np.ndarray],
                 fit_config: dict) -> SecureRound:
    """One round of SecAggPlusWorkflow: the devices train inside its collect_masked_vectors stage; the server
    gets the token-weighted mean of the sent tensors and of the devices' losses, never a device's own."""
    names = list(sent)
    m_weight, clip = max_weight(cfg, manifest), float(cfg.secagg_clip)
    counting = _CountingGrid(grid)
    strategy = _SecureFedAvg(len(nodes), {**fit_config, "names": names_digest(names)})
    manager = SimpleClientManager()
    for n in nodes:
        manager.register(GridClientProxy(node_id=n, grid=counting, run_id=grid.run.run_id))
    legacy = LegacyContext(context, strategy=strategy, client_manager=manager)
    legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: rnd})
    legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters([np.ascontiguousarray(sent[n], dtype=np.float32) for n in names]), keep_input=True)
    workflow = SecAggPlusWorkflow(shares(cfg), threshold(cfg), max_weight=float(m_weight), clipping_range=clip,
                                  quantization_range=QUANTIZATION_RANGE, modulus_range=MODULUS_RANGE,
                                  timeout=cfg.round_timeout_s)
    try:
        with np.errstate(divide="ignore", invalid="ignore"):   # all declined: unmask divides by a zero weight sum
            workflow(counting, legacy)
    finally:        # the ServerApp's own state keeps nothing of the round
        del legacy.state.array_records[MAIN_PARAMS_RECORD]
        del legacy.state.config_records[MAIN_CONFIGS_RECORD]

    seen = strategy.seen or []
    trained = sorted((int(m["device"]), n) for n, m in seen if not m["declined"])
    declined = {int(m["device"]): str(m["reason"]) for _, m in seen if m["declined"]}
    failed = [f"node {nid} ({STAGES[i]}): {reason}" for i, s in enumerate(counting.stages)
              for nid, reason in s["errors"]]
    missing = sorted({nid for s in counting.stages for nid in s["missing"]})
    total = sum(w for _, w in trained)
    released = loss = None
    if strategy.mean is not None:
        if len(strategy.mean) != len(names) + 1:
            raise RuntimeError(f"SecAgg+ returned {len(strategy.mean)} arrays for {len(names)} tensors + the loss")
        released = {n: v.astype(np.float32).reshape(np.shape(sent[n])) for n, v in zip(names, strategy.mean)}
        loss = float(strategy.mean[-1][0]) * LOSS_RANGE / clip
    if strategy.seen is None:
        failed.append(f"SecAgg+ halted before the unmask stage finished (threshold {threshold(cfg)} of "
                      f"{shares(cfg)} shares): the round is not released")
    step = 2 * clip / QUANTIZATION_RANGE
    record = {
        "secagg": True,
        "loss": loss,                                   # the token-weighted mean, from the masked sum
        "participants": [d for d, _ in trained], "declined": dict(sorted(declined.items())), "failed": failed,
        "missing": len(missing),
        "weights": [float(w) for _, w in trained],      # FitRes.num_examples: in the clear under SecAgg+
        "device_loss": None, "product_gap": None,       # unknown to the server: it never has a device's tensors
        "bytes_up": int(sum(s["up"] for s in counting.stages)),
        "bytes_down": int(sum(s["down"] for s in counting.stages)),
        "secagg_detail": {
            "released": released is not None, "shares": shares(cfg), "threshold": threshold(cfg), "clip": clip,
            "quantization_range": QUANTIZATION_RANGE, "max_weight": m_weight,
            "error_bound": (2 * step * len(trained) * m_weight / total) if total > 0 else None,
            "stages": {STAGES[i] if i < len(STAGES) else str(i): {k: s[k] for k in ("up", "down", "answered")}
                       for i, s in enumerate(counting.stages)},
        },
    }
    return SecureRound(released, record)

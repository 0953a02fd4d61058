// Batching and data order, as ort_trainer/data.py: collate (right padding) and DataOrder (a
// deterministic, resumable order; the same micro-batches as the Python runner for the same seed:
// epoch e uses np.random.default_rng([seed, e]).permutation(n), reproduced bit-exactly by
// nprandom.mjs). State dicts are interchangeable with Python's DataOrder.state_dict().

import { DataError, ValueError } from "./errors.mjs";
import { IGNORE_INDEX, lossTokenCount } from "./records.mjs";
import { defaultRng } from "./nprandom.mjs";
import { pyRepr } from "./pystr.mjs";

export { IGNORE_INDEX, lossTokenCount };

/**
 * Right-pad a micro-batch to its longest example (or to padTo).
 * Returns {input_ids, attention_mask, labels} as row-major BigInt64Array [B, L] (the int64 tensors
 * the ORT graph takes; padding = padId, mask 0, labels -100) and dims = [B, L].
 */
export function collate(examples, padId, padTo = null) {
  if (!examples.length) throw new ValueError("collate: no examples");
  const longest = Math.max(...examples.map((e) => e.input_ids.length));
  const length = padTo === null || padTo === undefined ? longest : Math.trunc(Number(padTo));
  if (length < longest) {
    throw new ValueError(`collate: pad_to=${padTo} is shorter than the longest example (${longest} tokens)`);
  }
  const b = examples.length;
  const inputIds = new BigInt64Array(b * length).fill(BigInt(padId));
  const attentionMask = new BigInt64Array(b * length);
  const labels = new BigInt64Array(b * length).fill(BigInt(IGNORE_INDEX));
  examples.forEach((e, i) => {
    const n = e.input_ids.length;
    if (e.labels.length !== n) throw new ValueError(`collate: example ${i} has ${n} input_ids but ${e.labels.length} labels`);
    for (let t = 0; t < n; t++) {
      inputIds[i * length + t] = BigInt(e.input_ids[t]);
      attentionMask[i * length + t] = 1n;
      labels[i * length + t] = BigInt(e.labels[t]);
    }
  });
  return { input_ids: inputIds, attention_mask: attentionMask, labels, dims: [b, length] };
}

function toInt(v) {
  // Python int(): for the state dict fields
  if (typeof v === "number") {
    if (!Number.isFinite(v)) throw new ValueError(`cannot convert float ${v > 0 ? "infinity" : v < 0 ? "-infinity" : "NaN"} to integer`);
    return Math.trunc(v);
  }
  if (typeof v === "bigint") return Number(v);
  if (typeof v === "boolean") return v ? 1 : 0;
  if (typeof v === "string" && /^\s*[+-]?\d+(_\d+)*\s*$/.test(v)) return Number(v.trim().replaceAll("_", ""));
  if (typeof v === "string") throw new ValueError(`invalid literal for int() with base 10: ${pyRepr(v)}`);
  const t = v === null || v === undefined ? "NoneType" : Array.isArray(v) ? "list" : "dict";
  throw new TypeError(`int() argument must be a string, a bytes-like object or a real number, not '${t}'`);
}

function toBigInt(v) {
  if (typeof v === "bigint") return v;
  if (typeof v === "string" && /^\s*[+-]?\d+(_\d+)*\s*$/.test(v)) return BigInt(v.trim().replaceAll("_", ""));
  return BigInt(toInt(v));
}

function pyTruthy(v) {
  if (v === null || v === undefined || v === false || v === 0 || v === "" || v === 0n) return false;
  if (Array.isArray(v)) return v.length > 0;
  if (typeof v === "object") return Object.keys(v).length > 0;
  return true;
}

const pyBool = (b) => (b ? "True" : "False");

export class DataOrder {
  static GROUP_BATCHES = 32;
  static VERSION = 1;

  /**
   * Deterministic, resumable order over n examples: epoch e uses
   * np.random.default_rng([seed, e]).permutation(n); micro-batches are consecutive slices (drop_last
   * when n >= batchSize, else one short batch of all n per epoch). `lengths` (token count per
   * example) turns on group_by_length: mega-batches of GROUP_BATCHES micro-batches sorted longest
   * first, cut into micro-batches whose order is shuffled with the same generator.
   */
  constructor(n, seed, batchSize, lengths = null) {
    n = Math.trunc(Number(n));
    batchSize = Math.trunc(Number(batchSize));
    if (n < 1) throw new DataError(`DataOrder: no examples (n=${n})`);
    if (batchSize < 1) throw new ValueError(`DataOrder: batch_size must be >= 1 (got ${batchSize})`);
    this.n = n;
    this.seed = typeof seed === "bigint" ? seed : BigInt(Math.trunc(Number(seed)));
    this.batchSize = batchSize;
    if (lengths !== null && lengths !== undefined && lengths.length !== n) {
      throw new ValueError(`DataOrder: ${lengths.length} lengths for ${n} examples`);
    }
    this.lengths = lengths === null || lengths === undefined ? null : Float64Array.from(lengths, Number);
    this.epoch = 0;
    this.position = 0;
    this._permEpoch = -1;
    this._perm = null;
  }

  get _take() {
    return Math.min(this.batchSize, this.n);
  }

  /** Micro-batches per epoch (n // batch_size, at least 1). */
  stepsPerEpoch() {
    return Math.max(1, Math.floor(this.n / this.batchSize));
  }

  get stepInEpoch() {
    return Math.floor(this.position / this._take);
  }

  /** Epochs done as a float (e.g. 1.5 = halfway through the second epoch). */
  get epochProgress() {
    return this.epoch + this.stepInEpoch / this.stepsPerEpoch();
  }

  /** The order of epoch `epoch` (Int32Array of example indices). */
  permutation(epoch) {
    if (epoch !== this._permEpoch) {
      const rng = defaultRng([this.seed, BigInt(epoch)]);
      const perm = rng.permutation(this.n);
      this._perm = this.lengths === null ? perm : this._grouped(perm, rng);
      this._permEpoch = epoch;
    }
    return this._perm;
  }

  _grouped(perm, rng) {
    const take = this._take;
    const mega = take * DataOrder.GROUP_BATCHES;
    const out = [];
    for (let m = 0; m < perm.length; m += mega) {
      const chunk = Array.from(perm.subarray(m, m + mega));
      // np.argsort(-lengths[chunk], kind="stable"): longest first, ties keep permutation order
      const order = chunk.map((_, i) => i).sort((a, b) => this.lengths[chunk[b]] - this.lengths[chunk[a]] || a - b);
      const sorted = order.map((i) => chunk[i]);
      const batches = [];
      for (let i = 0; i < sorted.length; i += take) batches.push(sorted.slice(i, i + take));
      const full = batches.filter((b) => b.length === take);
      for (const i of rng.permutation(full.length)) out.push(...full[i]);
      for (const b of batches) if (b.length < take) out.push(...b);
    }
    return Int32Array.from(out);
  }

  /** Indices of the next micro-batch and the epoch it belongs to: [indices, epoch]. */
  nextBatch() {
    const take = this._take;
    const epoch = this.epoch;
    const perm = this.permutation(epoch);
    const idx = Array.from(perm.subarray(this.position, this.position + take));
    this.position += take;
    if (this.position + take > this.n) {
      this.epoch += 1;
      this.position = 0;
    }
    return [idx, epoch];
  }

  /** The same keys and values as Python's DataOrder.state_dict() (JSON-safe: a seed beyond 2**53 is
   * a decimal string, which both sides' loaders accept). */
  stateDict() {
    const seed = this.seed <= BigInt(Number.MAX_SAFE_INTEGER) && this.seed >= -BigInt(Number.MAX_SAFE_INTEGER)
      ? Number(this.seed) : String(this.seed);
    return { version: DataOrder.VERSION, epoch: this.epoch, position: this.position, seed, n: this.n,
      batch_size: this.batchSize, group_by_length: this.lengths !== null };
  }

  loadStateDict(d) {
    let n, seed, bs, epoch, position;
    try {
      for (const key of ["n", "seed", "batch_size", "epoch", "position"]) {
        if (d === null || typeof d !== "object" || !(key in d)) {
          const e = new Error();
          e.pyRepr = `KeyError(${pyRepr(key)})`;
          throw e;
        }
        const v = key === "seed" ? toBigInt(d[key]) : toInt(d[key]);
        if (key === "n") n = v;
        else if (key === "seed") seed = v;
        else if (key === "batch_size") bs = v;
        else if (key === "epoch") epoch = v;
        else position = v;
      }
    } catch (e) {
      const repr = e.pyRepr ?? `${e instanceof TypeError ? "TypeError" : "ValueError"}(${pyRepr(e.message)})`;
      throw new DataError(`data order state is incomplete or malformed (${repr}); it needs epoch, position, ` +
        "seed, n and batch_size");
    }
    if (n !== this.n) {
      throw new DataError(`the data changed since the run started: the checkpoint's data order has n=${n} ` +
        `examples, the data now gives ${this.n}; resume with the same data file, tokenizer ` +
        "and seq_len, or start a new run");
    }
    if (seed !== this.seed) {
      throw new DataError(`the data order changed since the run started: the checkpoint used seed=${seed}, ` +
        `now seed=${this.seed}; resume with the same seed, or start a new run`);
    }
    if (bs !== this.batchSize) {
      throw new DataError(`the micro-batch size changed since the run started (checkpoint ${bs}, now ` +
        `${this.batchSize}); resume with the same batch size, or start a new run`);
    }
    const grouped = pyTruthy(d.group_by_length ?? false);
    if (grouped !== (this.lengths !== null)) {
      throw new DataError("length grouping changed since the run started (checkpoint " +
        `group_by_length=${pyBool(grouped)}); resume with the same ` +
        "setting, or start a new run");
    }
    if (epoch < 0 || position < 0 || position % this._take || position + this._take > this.n) {
      throw new DataError(`data order state is inconsistent (epoch=${epoch}, position=${position}, n=${n}, ` +
        `batch_size=${bs})`);
    }
    this.epoch = epoch;
    this.position = position;
  }
}

/** The order a run takes its micro-batches in (length grouping uses each example's token count). */
export function dataOrder(examples, seed, microBatch, groupByLength = false) {
  return new DataOrder(examples.length, seed, microBatch,
    groupByLength ? examples.map((e) => e.input_ids.length) : null);
}

/** The micro-batches of one optimizer step: the next `accum` micro-batches of `order`, collated. */
export function stepBatches(examples, order, accum, padId) {
  const out = [];
  for (let k = 0; k < accum; k++) out.push(collate(order.nextBatch()[0].map((i) => examples[i]), padId));
  return out;
}


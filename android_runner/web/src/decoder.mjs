// Generation on the bundle's KV-cache decoder (decoder_model.onnx, artifacts_gen/decoder.py) in onnxruntime-web:
// the JS twin of ort_trainer/decoder.py. One InferenceSession over the bundle's own shards; the LoRA tensors are
// inputs (zeros: the base model), so a trained state's adapter is swapped in per call, no re-export.
// Rows are left-padded; each step feeds one token per row and the cache the previous step returned.
import { fileWithRole } from './engine.mjs';

export class DecoderError extends Error {}

export class Decoder {
  /** ort: the onnxruntime-web module; bundle: {manifest, read(relPath) -> Promise<Uint8Array>}. */
  static async open(ort, bundle, options = {}) {
    const man = bundle.manifest;
    const spec = man.decoder ?? {};
    if (!spec.file) {
      throw new DecoderError('this bundle has no decoder graph (built before 2026-12-05): rebuild it with `pocketlora gen`');
    }
    const model = await bundle.read(fileWithRole(man, 'decoder_model', spec.file));
    const externalData = [];
    for (const entry of man.files.filter((e) => e.role === 'shard')) {
      externalData.push({ path: entry.path, data: await bundle.read(entry.path) });
    }
    const session = await ort.InferenceSession.create(model, {
      externalData, logSeverityLevel: 3, graphOptimizationLevel: 'all', ...(options.sessionOptions ?? {}),
    });
    externalData.length = 0;
    options.collectGarbage?.();
    return new Decoder(ort, man, session);
  }

  constructor(ort, manifest, session) {
    this.ort = ort;
    this.manifest = manifest;
    this.spec = manifest.decoder;
    this.session = session;
    this.useAdapter(null);
  }

  get maxPositions() { return this.spec.max_positions; }

  /** lora: Map or object onnx_name -> Float32Array (the engine's params), or null for the base model. */
  useAdapter(lora) {
    this.adapter = {};
    const get = (n) => (!lora ? new Float32Array(this._size(n)) : lora instanceof Map ? lora.get(n) : lora[n]);
    for (const t of this.manifest.trainable) {
      const data = get(t.onnx_name);
      const size = t.shape.reduce((a, d) => a * d, 1);
      if (!data || data.length !== size) {
        throw new DecoderError(`adapter: ${t.onnx_name} missing or of the wrong size; use a state trained on this bundle`);
      }
      this.adapter[t.onnx_name] = new this.ort.Tensor('float32', Float32Array.from(data), t.shape);
    }
  }

  _size(name) {
    return this.manifest.trainable.find((t) => t.onnx_name === name).shape.reduce((a, d) => a * d, 1);
  }

  emptyCache(batch) {
    const { kv_heads: h, head_dim: d, num_layers: layers } = this.spec;
    return Array.from({ length: 2 * layers }, () => new this.ort.Tensor('float32', new Float32Array(0), [batch, h, 0, d]));
  }

  /** One call of the graph: ids / mask / positions as BigInt64Arrays of [B, S], [B, P + S], [B, S]. */
  async step(ids, mask, positions, batch, cache) {
    const T = this.ort.Tensor;
    const S = ids.length / batch;
    const feeds = {
      input_ids: new T('int64', ids, [batch, S]),
      attention_mask: new T('int64', mask, [batch, mask.length / batch]),
      position_ids: new T('int64', positions, [batch, S]),
      ...this.adapter,
    };
    for (let i = 0; i < this.spec.num_layers; i++) {
      feeds[`past.${i}.key`] = cache[2 * i];
      feeds[`past.${i}.value`] = cache[2 * i + 1];
    }
    const out = await this.session.run(feeds);
    for (const t of cache) t.dispose?.();
    const next = [];
    for (let i = 0; i < this.spec.num_layers; i++) next.push(out[`present.${i}.key`], out[`present.${i}.value`]);
    const logits = out.logits.data;
    out.logits.dispose?.();
    return { logits: Float32Array.from(logits), cache: next };
  }
}

/** A seeded generator of floats in [0, 1) (mulberry32): sampling reproducible for a seed. */
export function seededRandom(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** The next token of one row's logits: argmax at temperature 0, else top-k, then top-p, then a seeded draw. */
export function pick(row, { temperature = 0, topK = 0, topP = 1 }, random) {
  let best = 0;
  for (let v = 1; v < row.length; v++) if (row[v] > row[best]) best = v;
  if (!temperature) return best;
  let order = Array.from(row.keys()).sort((x, y) => row[y] - row[x] || x - y);
  if (topK > 0) order = order.slice(0, topK);
  const w = order.map((v) => Math.exp((row[v] - row[best]) / temperature));
  const total = w.reduce((a, b) => a + b, 0);
  let keep = order.length, mass = 0;
  for (let k = 0; k < order.length; k++) {
    if (mass >= topP) { keep = k; break; }
    mass += w[k] / total;
  }
  const kept = w.slice(0, keep), sum = kept.reduce((a, b) => a + b, 0);
  let r = random() * sum;
  for (let k = 0; k < keep; k++) { r -= kept[k]; if (r < 0) return order[k]; }
  return order[keep - 1];
}

/**
 * New token ids for each prompt (arrays of numbers), all rows together. A row ends at a stop id (not kept) or after
 * maxNewTokens. onToken(row, id) sees each new token; onLogits(Float32Array [B*V]) each step's logits.
 */
export async function generate(decoder, prompts, sampling, stopIds, padId, { onToken, onLogits } = {}) {
  if (!prompts.length || prompts.some((p) => p.length === 0)) throw new DecoderError('empty prompt: give some text');
  const longest = Math.max(...prompts.map((p) => p.length));
  if (longest >= decoder.maxPositions) {
    throw new DecoderError(`prompt of ${longest} tokens: the model's context is ${decoder.maxPositions} tokens; shorten it`);
  }
  const budget = Math.min(sampling.maxNewTokens ?? 128, decoder.maxPositions - longest);
  const B = prompts.length, V = decoder.manifest.model.vocab_size;
  const ids = new BigInt64Array(B * longest).fill(BigInt(padId));
  let mask = new BigInt64Array(B * longest);
  const positions = new BigInt64Array(B * longest);
  const last = new Array(B).fill(0);
  prompts.forEach((p, b) => {
    const off = longest - p.length;
    p.forEach((tok, t) => {
      ids[b * longest + off + t] = BigInt(tok);
      mask[b * longest + off + t] = 1n;
      positions[b * longest + off + t] = BigInt(t);
    });
    last[b] = p.length - 1;
  });
  const random = seededRandom(sampling.seed ?? 0);
  const out = prompts.map(() => []);
  const ended = new Array(B).fill(false);
  let { logits, cache } = await decoder.step(ids, mask, positions, B, decoder.emptyCache(B));
  for (let k = 0; k < budget; k++) {
    onLogits?.(logits);
    const next = new BigInt64Array(B);
    for (let b = 0; b < B; b++) {
      const tok = pick(logits.subarray(b * V, (b + 1) * V), sampling, random);
      if (!ended[b]) {
        if (stopIds.has(tok)) ended[b] = true;
        else { out[b].push(tok); onToken?.(b, tok); }
      }
      next[b] = BigInt(ended[b] ? padId : tok);
    }
    if (ended.every(Boolean) || k === budget - 1) break;
    const width = mask.length / B;
    const grown = new BigInt64Array(B * (width + 1));
    for (let b = 0; b < B; b++) {
      grown.set(mask.subarray(b * width, (b + 1) * width), b * (width + 1));
      grown[b * (width + 1) + width] = 1n;
      last[b] += 1;
    }
    mask = grown;
    ({ logits, cache } = await decoder.step(next, mask, BigInt64Array.from(last, BigInt), B, cache));
  }
  for (const t of cache) t.dispose?.();
  return out;
}

/** Token ids that end the model's turn: eos, and the special token the chat template writes right after an
 * assistant's message (ort_trainer/tokenizer.py turn_end_ids). */
export function turnEndIds(tok) {
  const ends = new Set([tok.eosId].filter((x) => x !== null && x !== undefined));
  const marker = '\u0000answer\u0000';
  const text = tok.renderChat([{ role: 'user', content: 'q' }, { role: 'assistant', content: marker }]);
  const at = text.indexOf(marker);
  if (at >= 0) {
    const first = tok.encode(text.slice(at + marker.length), false).slice(0, 1);
    if (first.length && tok.decode(first, true) === '') ends.add(first[0]);
  }
  return ends;
}

// The training engine: a bundle's LoRA trained on onnxruntime-web's WASM build, in Node or a browser.
//
// No TrainingSession: it cannot mount the bundle's external-data shards, has no learning-rate setter and no
// read-out of AdamW's moments. Instead one plain InferenceSession runs the bundle's gradient graph
// (web_training_model.onnx, derived by artifacts_gen/web_graphs.py): inputs input_ids, attention_mask,
// labels, loss_scale and the LoRA tensors; outputs the loss and one gradient per LoRA tensor. The engine owns
// the LoRA tensors, the summed gradients, AdamW's moments and the step as Float32Arrays, applies clipping and
// AdamW itself with ORT's float32 arithmetic (adamw.mjs), and serialises all of it to one safetensors file:
// a resume is exact by construction.
//
// One optimizer step is ort_trainer/step.py: each micro-batch's loss_scale is 1/N, N = labelled tokens of the
// whole effective batch, so the summed gradient is the gradient of the effective batch's mean loss.
//
// The engine is platform-free: the caller passes the `ort` module (see ort_node.mjs for Node; in a browser
// `import * as ort from 'onnxruntime-web/training'`) and a bundle reader {manifest, read(relPath) -> Uint8Array}.
import { readSafetensors, writeSafetensors } from './safetensors.mjs';
import { adamwSpec, adamwStep, clipGradNorm, globalNorm } from './adamw.mjs';

export const WEB_TRAINING_MODEL = 'web_training_model.onnx';
export const WEB_LORA_INIT = 'web_lora_init.safetensors';
export const STATE_FORMAT = 'pocketlora-web-state/1';
export const IGNORE_INDEX = -100n;
export const INPUT_NAMES = ['input_ids', 'attention_mask', 'labels', 'loss_scale'];

export class EngineError extends Error {}

/** The bundle file with `role` in the manifest, else `fallback` (the fixed name). */
export function fileWithRole(manifest, role, fallback) {
  const entry = manifest.files.find((e) => e.role === role);
  return entry ? entry.path : fallback;
}

/** A micro-batch from rows of numbers: {dims: [B, L], input_ids, attention_mask, labels: BigInt64Array}. */
export function makeBatch({ input_ids, attention_mask, labels }) {
  const B = input_ids.length, L = input_ids[0].length;
  const flat = (rows) => {
    const out = new BigInt64Array(B * L);
    rows.forEach((row, b) => {
      if (row.length !== L) throw new EngineError(`micro-batch row ${b} has ${row.length} tokens, not ${L}`);
      row.forEach((x, t) => { out[b * L + t] = BigInt(x); });
    });
    return out;
  };
  return { dims: [B, L], input_ids: flat(input_ids), attention_mask: flat(attention_mask), labels: flat(labels) };
}

/** Labelled tokens HF's shifted loss averages over: labels[:, 1:] != -100 (ort_trainer.data.loss_token_count). */
export function lossTokenCount(batch) {
  const [B, L] = batch.dims;
  let n = 0;
  for (let b = 0; b < B; b++) for (let t = 1; t < L; t++) if (batch.labels[b * L + t] !== IGNORE_INDEX) n++;
  return n;
}

export function realTokenCount(batch) {
  let n = 0;
  for (const x of batch.attention_mask) n += Number(x);
  return n;
}

const now = () => (globalThis.performance ?? Date).now();

// A single-threaded WASM run resolves its promise without returning to the event loop, so signal handlers
// (Node) and UI events (browser) would wait for the whole run. Yield between micro-batches.
export const yieldToEventLoop = () => new Promise((resolve) => (globalThis.setImmediate ?? setTimeout)(resolve));

export class LoraEngine {
  /**
   * ort: the onnxruntime-web training module. bundle: {manifest, read(relPath) -> Promise<Uint8Array>}.
   * options.adamw: {clip, weight_decay} overriding the manifest's optimizer (as `pocketlora train` does).
   * options.sessionOptions: extra InferenceSession options.
   * options.collectGarbage: () => void, called once the session holds the weights (Node: src/node/ort.mjs). The
   *   shards' JS copies (1.07 GB for Gemma3-270M) are garbage then, but V8 may keep them for many steps: in the
   *   demo's run they were still resident at step 2, whose activations grew the WASM heap (peak RSS 3.72 GB).
   */
  static async open(ort, bundle, options = {}) {
    const man = bundle.manifest;
    const modelPath = fileWithRole(man, 'web_training_model', WEB_TRAINING_MODEL);
    let model;
    try {
      model = await bundle.read(modelPath);
    } catch (e) {
      throw new EngineError(`${modelPath}: not in the bundle (${e.message}). Add the web files with ` +
        '`python -m artifacts_gen.web_graphs BUNDLE` on the workstation.');
    }
    const externalData = [];
    for (const entry of man.files.filter((e) => e.role === 'shard')) {
      externalData.push({ path: entry.path, data: await bundle.read(entry.path) });
    }
    // No prepacking, as ORT's training Module (ort_trainer/session.py): prepacked copies of the frozen MatMul
    // weights do not fit WASM's 4 GB heap beside the weights themselves (Gemma3-270M: the session could not be
    // created, heap exhausted; without them, 2.75 GB RSS after creation, the shards' JS copies included).
    const session = await ort.InferenceSession.create(model, {
      externalData, logSeverityLevel: 3, graphOptimizationLevel: 'all',
      extra: { session: { disable_prepacking: '1' } }, ...(options.sessionOptions ?? {}),
    });
    externalData.length = 0;                  // ORT has copied the weights into its heap; drop the JS copies
    options.collectGarbage?.();
    const init = readSafetensors(await bundle.read(fileWithRole(man, 'web_lora_init', WEB_LORA_INIT)));
    return new LoraEngine(ort, man, session, init.tensors, { ...man.optimizer, ...(options.adamw ?? {}) });
  }

  constructor(ort, manifest, session, initial, optimizer) {
    this.ort = ort;
    this.manifest = manifest;
    this.session = session;
    this.names = manifest.trainable.map((t) => t.onnx_name);
    this.shapes = manifest.trainable.map((t) => t.shape);
    this.gradNames = this.names.map((n) => n + '_grad');
    for (const n of [...INPUT_NAMES, ...this.names]) {
      if (!session.inputNames.includes(n)) throw new EngineError(`the web training graph has no input ${n}; rebuild the web files`);
    }
    for (const n of ['loss', ...this.gradNames]) {
      if (!session.outputNames.includes(n)) throw new EngineError(`the web training graph has no output ${n}; rebuild the web files`);
    }
    this.params = this.names.map((n, k) => {
      const t = initial.get(n);
      const size = this.shapes[k].reduce((a, d) => a * d, 1);
      if (!t || t.data.length !== size) throw new EngineError(`initial LoRA: ${n} missing or of the wrong size`);
      return t.data;
    });
    this.m = this.params.map((p) => new Float32Array(p.length));
    this.v = this.params.map((p) => new Float32Array(p.length));
    this.grads = this.params.map((p) => new Float32Array(p.length));
    this.optimizer = optimizer;
    this.spec = adamwSpec(optimizer);
    this.optimizerStep = 0;        // completed AdamW updates (ORT's optimizer_state.step)
  }

  _feeds(batch, lossScale) {
    const T = this.ort.Tensor;
    const feeds = {
      input_ids: new T('int64', batch.input_ids, batch.dims),
      attention_mask: new T('int64', batch.attention_mask, batch.dims),
      labels: new T('int64', batch.labels, batch.dims),
      loss_scale: new T('float32', new Float32Array([lossScale]), []),
    };
    // The session copies inputs into WASM memory: the engine's arrays are never aliased.
    this.names.forEach((n, k) => { feeds[n] = new T('float32', this.params[k], this.shapes[k]); });
    return feeds;
  }

  /** One forward/backward: returns the loss (loss_scale x summed NLL) and adds the gradients into this.grads
   * (reset: overwrite them, as ORT's lazy_reset_grad). */
  async forwardBackward(batch, lossScale, reset) {
    const out = await this.session.run(this._feeds(batch, Math.fround(lossScale)));
    const loss = out.loss.data[0];
    this.gradNames.forEach((n, k) => {
      const g = out[n].data, acc = this.grads[k];
      if (g.length !== acc.length) throw new EngineError(`${n}: ${g.length} values, expected ${acc.length}`);
      if (reset) acc.set(g);
      else for (let i = 0; i < acc.length; i++) acc[i] += g[i];   // float32 store: InPlaceAccumulatorV2's add
    });
    for (const t of Object.values(out)) t.dispose?.();
    return loss;
  }

  /**
   * One optimizer step over `microBatches` (ort_trainer.step.train_step): token-weighted accumulation, clip,
   * AdamW at learning rate `lr` (rounded to float32). Returns {loss, grad_norm, tokens, label_tokens, seconds},
   * or null, with nothing changed, if shouldStop() turns true between micro-batches.
   */
  async trainStep(microBatches, lr, shouldStop = () => false) {
    const t0 = now();
    const counts = microBatches.map(lossTokenCount);
    const n = counts.reduce((a, b) => a + b, 0);
    if (n === 0) throw new EngineError('an optimizer step with no labelled tokens; the data loader should have dropped these examples');
    let loss = 0, reset = true;
    for (let i = 0; i < microBatches.length; i++) {
      if (counts[i] === 0) continue;
      loss += await this.forwardBackward(microBatches[i], 1.0 / n, reset);
      reset = false;
      await yieldToEventLoop();
      if (shouldStop()) return null;          // the accumulated gradients are simply not used
    }
    const gradNorm = Math.sqrt(this.grads.reduce((s, g) => s + g.reduce((a, x) => a + x * x, 0), 0));
    if (this.spec.maxNorm !== null) clipGradNorm(this.grads, this.spec.maxNorm);
    adamwStep(this.spec, this.params, this.grads, this.m, this.v, Math.fround(lr), this.optimizerStep + 1);
    this.optimizerStep += 1;
    const tokens = microBatches.reduce((a, b) => a + realTokenCount(b), 0);
    return { loss, grad_norm: gradNorm, tokens, label_tokens: n, seconds: (now() - t0) / 1000 };
  }

  /** LoRA tensors by ONNX name (views of the live arrays). */
  lora() {
    return Object.fromEntries(this.names.map((n, k) => [n, this.params[k]]));
  }

  /** Everything the optimizer needs to continue exactly: LoRA tensors (keyed by ONNX name, ONNX layout, what
   * Python's export reads), AdamW moments (adamw.m.<name>, adamw.v.<name>) and the optimizer step. */
  saveState(metadata = {}) {
    const entries = [];
    this.names.forEach((n, k) => entries.push([n, this.shapes[k], this.params[k]]));
    this.names.forEach((n, k) => entries.push([`adamw.m.${n}`, this.shapes[k], this.m[k]]));
    this.names.forEach((n, k) => entries.push([`adamw.v.${n}`, this.shapes[k], this.v[k]]));
    return writeSafetensors(entries, {
      ...metadata, format: STATE_FORMAT, optimizer_step: this.optimizerStep,
      adamw: JSON.stringify(this.optimizer),
    });
  }

  loadState(bytes) {
    const { tensors, metadata } = readSafetensors(bytes);
    if (metadata.format !== STATE_FORMAT) throw new EngineError(`not a web runner state (format ${metadata.format})`);
    const take = (key, k) => {
      const t = tensors.get(key);
      if (!t || t.data.length !== this.params[k].length) throw new EngineError(`state: ${key} missing or of the wrong size`);
      return t.data;
    };
    this.params = this.names.map((n, k) => take(n, k));
    this.m = this.names.map((n, k) => take(`adamw.m.${n}`, k));
    this.v = this.names.map((n, k) => take(`adamw.v.${n}`, k));
    this.optimizerStep = Number(metadata.optimizer_step);
    return metadata;
  }

  async release() {
    await this.session.release();
  }
}

export { globalNorm };

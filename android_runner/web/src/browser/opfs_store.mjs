// The run directory in the browser's Origin Private File System (navigator.storage.getDirectory()): the store
// interface src/runner.mjs trains through (node/store.mjs is the filesystem one), laid out as
//
//   pocketlora/current.json                    {key, bundle_sha256}: the run to offer after a reload
//   pocketlora/runs/<key>/run.json             settings (+ "runner": "web", data_name)
//   pocketlora/runs/<key>/data<.ext>           the training file, copied here: a reload continues without it
//   pocketlora/runs/<key>/metrics.json         the per-step records up to the newest checkpoint
//   pocketlora/runs/<key>/step-00000042.safetensors   LoRA + AdamW moments (engine.saveState)
//   pocketlora/runs/<key>/step-00000042.json          step, data position, ..., the weights' sha256 and size
//   pocketlora/runs/<key>/summary.json
//
// key = sha256(bundle manifest hash + data hash): the same bundle and file find their run again, and the
// runner refuses to continue it with other settings. Atomicity: a file written through createWritable() keeps
// its old contents until close() commits the new ones, so a closed tab never leaves a torn file; a checkpoint
// is its weights, then metrics.json, then the small state record last (the pointer). A state record whose
// weights are missing or fail their checksum is skipped for the one before, as ort_trainer/checkpoint.py does.
// The newest 2 checkpoints are kept.
export const ROOT = 'pocketlora';
export const PREFIX = 'step-';
const STATE_RE = /^step-(\d{8})\.json$/;
const KEEP = 2;

const enc = new TextEncoder();
const dec = new TextDecoder();

export async function sha256Hex(bytes) {
  const digest = await crypto.subtle.digest('SHA-256', bytes);
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, '0')).join('');
}

async function writeFile(dir, name, bytes) {
  const handle = await dir.getFileHandle(name, { create: true });
  const w = await handle.createWritable();          // a swap file until close()
  await w.write(typeof bytes === 'string' ? enc.encode(bytes) : bytes);
  await w.close();
}

async function readFile(dir, name) {
  try {
    const file = await (await dir.getFileHandle(name)).getFile();
    return new Uint8Array(await file.arrayBuffer());
  } catch (e) {
    if (e.name === 'NotFoundError' || e.name === 'TypeMismatchError') return null;
    throw e;
  }
}

async function readJson(dir, name) {
  const b = await readFile(dir, name);
  return b === null ? null : JSON.parse(dec.decode(b));
}

async function names(dir) {
  const out = [];
  for await (const name of dir.keys()) out.push(name);
  return out.sort();
}

async function root() {
  if (!navigator.storage?.getDirectory) {
    throw new Error('this browser has no Origin Private File System (navigator.storage.getDirectory); ' +
      'open the page at http://localhost:PORT or over https');
  }
  return (await navigator.storage.getDirectory()).getDirectoryHandle(ROOT, { create: true });
}

export async function runKey(bundleSha, dataSha) {
  return (await sha256Hex(enc.encode(`${bundleSha}\n${dataSha}`))).slice(0, 24);
}

/** {key, bundle_sha256} of the run the page last worked on, or null. */
export async function currentRun() {
  return readJson(await root(), 'current.json').catch(() => null);
}

export class OpfsRunStore {
  /** The run `key` (created when absent). hooks: onOpen(step), onStep(record) -> the record to keep. */
  static async open(key, hooks = {}) {
    const top = await root();
    const runs = await top.getDirectoryHandle('runs', { create: true });
    return new OpfsRunStore(top, runs, key, await runs.getDirectoryHandle(key, { create: true }), hooks);
  }

  constructor(top, runs, key, dir, hooks) {
    this.top = top;
    this.runs = runs;
    this.key = key;
    this.dir = dir;
    this.hooks = hooks;
    this.runDir = `OPFS ${ROOT}/runs/${key}`;
    this.records = [];
    this.resumedFrom = null;
    this.extraConfig = {};       // saved into run.json beside the settings (the page's data_name, data_file)
  }

  async markCurrent(bundleSha) {
    await writeFile(this.top, 'current.json', JSON.stringify({ key: this.key, bundle_sha256: bundleSha }));
  }

  async remove() {
    const cur = await currentRun();
    if (cur?.key === this.key) await this.top.removeEntry('current.json');
    await this.runs.removeEntry(this.key, { recursive: true });
  }

  // -- the training file ------------------------------------------------------------------------------------
  async saveData(name, bytes) {
    const ext = name.includes('.') ? name.slice(name.lastIndexOf('.')) : '';
    await writeFile(this.dir, `data${ext}`, bytes);
    return `data${ext}`;
  }

  async loadData(file) {
    return readFile(this.dir, file);
  }

  // -- src/runner.mjs's store interface ---------------------------------------------------------------------
  async loadConfig() {
    return readJson(this.dir, 'run.json');
  }

  async saveConfig(cfg) {
    await writeFile(this.dir, 'run.json', JSON.stringify({ ...this.extraConfig, ...cfg }, null, 1));
  }

  /** The newest checkpoint that verifies: {name, state, weights}; damaged ones are reported and skipped. */
  async latest(warn = console.warn) {
    const states = (await names(this.dir)).filter((n) => STATE_RE.test(n)).reverse();
    for (const name of states) {
      try {
        const state = await readJson(this.dir, name);
        const weights = await readFile(this.dir, state.weights_file);
        if (weights === null) throw new Error(`${state.weights_file}: missing`);
        if (weights.length !== state.weights_bytes) throw new Error(`${state.weights_file}: ${weights.length} bytes, expected ${state.weights_bytes} (truncated)`);
        if (await sha256Hex(weights) !== state.weights_sha256) throw new Error(`${state.weights_file}: checksum mismatch (damaged)`);
        this.resumedFrom = state.step;
        return { name: name.replace(/\.json$/, ''), state, weights };
      } catch (e) {
        warn(`warning: skipping damaged checkpoint ${name}: ${e.message}; falling back to the previous one`);
      }
    }
    return null;
  }

  async save(step, weights, record) {
    const base = `${PREFIX}${String(step).padStart(8, '0')}`;
    await writeFile(this.dir, `${base}.safetensors`, weights);
    await writeFile(this.dir, 'metrics.json', JSON.stringify(this.records.filter((r) => r.step <= step)));
    const state = { ...record, weights_file: `${base}.safetensors`, weights_sha256: await sha256Hex(weights), weights_bytes: weights.length };
    await writeFile(this.dir, `${base}.json`, JSON.stringify(state, null, 1));   // the pointer: last
    const kept = (await names(this.dir)).filter((n) => STATE_RE.test(n)).slice(-KEEP).map((n) => n.replace(/\.json$/, ''));
    for (const n of await names(this.dir)) {
      const m = /^(step-\d{8})\.(json|safetensors)$/.exec(n);
      if (m && !kept.includes(m[1]) && m[1] !== base) await this.dir.removeEntry(n).catch(() => {});
    }
    return `${this.runDir}/${base}`;
  }

  async openMetrics(keepThroughStep) {
    const saved = (await readJson(this.dir, 'metrics.json').catch(() => null)) ?? [];
    this.records = saved.filter((r) => r.step <= keepThroughStep);
    if (keepThroughStep === 0) this.resumedFrom = null;
    await this.hooks.onOpen?.(keepThroughStep);
  }

  async writeMetrics(record) {
    this.records.push((await this.hooks.onStep?.(record)) ?? record);
  }

  async closeMetrics() {}

  async writeSummary(summary) {
    await writeFile(this.dir, 'summary.json', JSON.stringify(summary, null, 1));
  }

  // -- for the page -------------------------------------------------------------------------------------------
  /** The records through the newest good checkpoint and that checkpoint (or null), without training. */
  async peek() {
    const was = this.resumedFrom;
    const found = await this.latest(() => {});
    this.resumedFrom = was;
    const saved = (await readJson(this.dir, 'metrics.json').catch(() => null)) ?? [];
    return { found, records: found ? saved.filter((r) => r.step <= found.state.step) : [] };
  }
}

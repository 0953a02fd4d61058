// The run directory on a filesystem, laid out as android_runner/loop.py + ort_trainer/checkpoint.py lay it out:
//
// RUN/run.json                      settings (RunConfig's fields, plus "runner": "web")
// RUN/metrics.jsonl                 one line per step; on resume, lines past the checkpoint are dropped
// RUN/summary.json
// RUN/checkpoints/step-00000042/
//     web_state.safetensors         LoRA tensors (ONNX names and layout) + AdamW moments; metadata: optimizer step
//     state.json                    step, total_steps, data position, seed, reason, weights_file + its sha256/bytes
//
// A checkpoint directory appears under its final name only complete and fsynced (tmp dir, fsync, rename,
// fsync the parent); a damaged one fails its checksum and the previous one is used. The newest 2 are kept.
import crypto from 'node:crypto';
import fs from 'node:fs';
import fsp from 'node:fs/promises';
import path from 'node:path';

export const RUN_CONFIG = 'run.json';
export const METRICS = 'metrics.jsonl';
export const SUMMARY = 'summary.json';
export const CHECKPOINTS = 'checkpoints';
export const WEIGHTS_FILE = 'web_state.safetensors';
export const STATE_FILE = 'state.json';
export const PREFIX = 'step-';

const sha256 = (bytes) => crypto.createHash('sha256').update(bytes).digest('hex');

function writeSynced(file, bytes) {
  const fd = fs.openSync(file, 'w');
  try {
    fs.writeSync(fd, bytes);
    fs.fsyncSync(fd);
  } finally {
    fs.closeSync(fd);
  }
}

function fsyncDir(dir) {
  const fd = fs.openSync(dir, 'r');
  try { fs.fsyncSync(fd); } finally { fs.closeSync(fd); }
}

export function writeFileAtomic(file, bytes) {
  const tmp = `${file}.tmp-${process.pid}`;
  writeSynced(tmp, bytes);
  fs.renameSync(tmp, file);
  fsyncDir(path.dirname(file));
}

export class CheckpointError extends Error {}

/** The state of a checkpoint directory, or CheckpointError saying what is wrong with it. */
export function verify(dir) {
  let state;
  try {
    state = JSON.parse(fs.readFileSync(path.join(dir, STATE_FILE), 'utf8'));
  } catch (e) {
    throw new CheckpointError(`${path.join(dir, STATE_FILE)}: unreadable (${e.message})`);
  }
  const file = path.join(dir, state.weights_file ?? WEIGHTS_FILE);
  if (!fs.existsSync(file)) throw new CheckpointError(`${file}: missing`);
  const bytes = fs.readFileSync(file);
  if (bytes.length !== state.weights_bytes) throw new CheckpointError(`${file}: ${bytes.length} bytes, expected ${state.weights_bytes} (truncated)`);
  if (sha256(bytes) !== state.weights_sha256) throw new CheckpointError(`${file}: checksum mismatch (damaged)`);
  return { state, weights: new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.length) };
}

export class NodeRunStore {
  constructor(runDir, { keep = 2 } = {}) {
    this.runDir = runDir;
    this.keep = keep;
    this.metrics = null;
  }

  async loadConfig() {
    const file = path.join(this.runDir, RUN_CONFIG);
    return fs.existsSync(file) ? JSON.parse(fs.readFileSync(file, 'utf8')) : null;
  }

  async saveConfig(cfg) {
    fs.mkdirSync(this.runDir, { recursive: true });
    writeFileAtomic(path.join(this.runDir, RUN_CONFIG), JSON.stringify(cfg, null, 1));
  }

  /** The newest checkpoint that verifies: {name, state, weights}; damaged ones are reported and skipped. */
  async latest(warn = console.warn) {
    const root = path.join(this.runDir, CHECKPOINTS);
    if (!fs.existsSync(root)) return null;
    const names = fs.readdirSync(root).filter((n) => n.startsWith(PREFIX)).sort().reverse();
    for (const name of names) {
      try {
        return { name, ...verify(path.join(root, name)) };
      } catch (e) {
        if (!(e instanceof CheckpointError)) throw e;
        warn(`warning: skipping damaged checkpoint ${name}: ${e.message}; falling back to the previous one`);
      }
    }
    return null;
  }

  async save(step, weights, record) {
    const root = path.join(this.runDir, CHECKPOINTS);
    fs.mkdirSync(root, { recursive: true });
    const name = `${PREFIX}${String(step).padStart(8, '0')}`;
    const final = path.join(root, name);
    const tmp = path.join(root, `.tmp-${name}-${process.pid}`);
    fs.rmSync(tmp, { recursive: true, force: true });
    fs.mkdirSync(tmp);
    writeSynced(path.join(tmp, WEIGHTS_FILE), weights);
    const state = { ...record, weights_file: WEIGHTS_FILE, weights_sha256: sha256(weights), weights_bytes: weights.length };
    writeSynced(path.join(tmp, STATE_FILE), JSON.stringify(state, null, 1));
    fsyncDir(tmp);
    if (fs.existsSync(final)) fs.rmSync(final, { recursive: true });
    fs.renameSync(tmp, final);
    fsyncDir(root);
    for (const stale of fs.readdirSync(root)) {
      if (stale.startsWith('.tmp-') && !stale.endsWith(`-${process.pid}`)) fs.rmSync(path.join(root, stale), { recursive: true, force: true });
    }
    const all = fs.readdirSync(root).filter((n) => n.startsWith(PREFIX)).sort();
    for (const old of all.slice(0, Math.max(0, all.length - this.keep))) fs.rmSync(path.join(root, old), { recursive: true, force: true });
    return final;
  }

  async openMetrics(keepThroughStep) {
    const file = path.join(this.runDir, METRICS);
    if (fs.existsSync(file)) {
      const kept = fs.readFileSync(file, 'utf8').split('\n').filter((line) => {
        try { return line.trim() && JSON.parse(line).step <= keepThroughStep; } catch { return false; }  // torn by a kill
      });
      writeFileAtomic(file, kept.map((l) => l + '\n').join(''));
    }
    this.metrics = fs.openSync(file, 'a');
  }

  async writeMetrics(record) {
    fs.writeSync(this.metrics, JSON.stringify(record) + '\n');
  }

  async closeMetrics() {
    if (this.metrics !== null) fs.closeSync(this.metrics);
    this.metrics = null;
  }

  async writeSummary(summary) {
    writeFileAtomic(path.join(this.runDir, SUMMARY), JSON.stringify(summary, null, 1));
  }

  rssMb() {
    return Math.round((process.memoryUsage().rss / 2 ** 20) * 10) / 10;
  }

  /** This process's peak RSS (MiB): VmHWM as android_runner/metrics.peak_rss_mb, else getrusage's maxRSS. */
  peakRssMb() {
    let kb = null;
    try {
      const m = /^VmHWM:\s+(\d+)\s+kB/m.exec(fs.readFileSync('/proc/self/status', 'utf8'));
      if (m) kb = Number(m[1]);
    } catch { /* not Linux */ }
    kb ??= process.resourceUsage().maxRSS;
    return Math.round((kb / 1024) * 10) / 10;
  }
}

/** The process's CPU seconds (user + system, all threads: WASM workers included), Python's time.process_time. */
export function cpuSeconds() {
  const u = process.cpuUsage();
  return (u.user + u.system) / 1e6;
}

/** A bundle directory: {path, manifest, read(relPath)}. */
export async function openBundleDir(dir) {
  const file = path.join(dir, 'manifest.json');
  if (!fs.existsSync(file)) throw new Error(`${file}: no manifest. Is ${dir} a bundle made by \`pocketlora gen\`?`);
  const manifest = JSON.parse(fs.readFileSync(file, 'utf8'));
  if (manifest.schema_version !== 1) throw new Error(`${file}: schema_version ${manifest.schema_version} is not supported (reads 1)`);
  for (const entry of manifest.files) {        // sizes, as a resumed Python run checks (hashes: TODO, slow on phones)
    const f = path.join(dir, entry.path);
    if (!fs.existsSync(f)) throw new Error(`${f}: missing from the bundle (listed in the manifest). Copy the whole bundle again.`);
    if (fs.statSync(f).size !== entry.bytes) throw new Error(`${f}: ${fs.statSync(f).size} bytes, the manifest says ${entry.bytes}. Copy it again.`);
  }
  return {
    path: dir, manifest,
    read: async (rel) => {
      const b = await fsp.readFile(path.join(dir, rel));
      return new Uint8Array(b.buffer, b.byteOffset, b.length);
    },
  };
}

// The page: pick a training file, train the bundle's LoRA in this tab (onnxruntime-web WASM), watch it, pause,
// resume (also after a reload), download the adapter as PEFT files. The training file is read from disk
// (<input type=file>) and copied into this origin's private storage; nothing the page sends carries it: the
// server it talks to (`pocketlora web`) only answers GET and HEAD.
//
// The run itself is src/runner.mjs's `train` (settings, resume rules, battery gate, checkpoints) over an OPFS
// store (opfs_store.mjs). The Pause button stops it after the current micro-batch with a checkpoint; Resume
// calls `train` again, which continues from that checkpoint exactly, as it does after a reload (from the last
// checkpoint: every `save_every` steps). The battery gate's pauses happen inside `train` (checkpoint, wait).
//
// #status holds the page's state as JSON for scripts and headless browsers:
//   {state: idle|loading|training|paused|gate-paused|done|error, step, total_steps, losses, tok_per_s, eta_s,
//    gate, error, crossOriginIsolated, threads, resumed_from, data, run, adapter,
//    chat: {busy, adapter_step, history: [{role, content, token_ids?}], tok_per_s, error}}
//
// The chat panel runs the bundle's decoder (../decoder.mjs) with the latest checkpoint's LoRA, when not training.
import * as ort from '/app/node_modules/onnxruntime-web/dist/ort.training.wasm.min.mjs';
import { RunError, interruptibleSleep, train } from '../runner.mjs';
import { Decoder, generate, turnEndIds } from '../decoder.mjs';
import { readSafetensors } from '../safetensors.mjs';
import { TextTokenizer, collate, dataOrder, loadExamples } from '../data/index.mjs';
import { GateConfig, GateState, GateTracker, SafeProbe, makeProbe } from '../gate/index.mjs';
import { openBundle } from './bundle.mjs';
import { OpfsRunStore, currentRun, runKey, sha256Hex } from './opfs_store.mjs';
import { peftFiles } from './peft.mjs';
import { drawLoss } from './plot.mjs';
import { PAGE_DEFAULTS, fromUrl, settingsForm } from './settings.mjs';

const DIST = '/app/node_modules/onnxruntime-web/dist/';
const $ = (sel) => document.querySelector(sel);

const status = {
  state: 'loading', step: 0, total_steps: null, losses: [], tok_per_s: null, eta_s: null, gate: null, error: null,
  crossOriginIsolated: globalThis.crossOriginIsolated === true, threads: null, resumed_from: null,
  data: null, run: null, adapter: null, chat: { busy: false, adapter_step: null, history: [], tok_per_s: null, error: null },
};
let decoder = null;             // opened on the first chat message

let bundle = null, form = null, url = null;
let tokenizer = null;
let run = null;                 // the selected file and its run: {key, store, name, bytes, sha256, examples, report, saved}
let busy = false, stopFlag = null;
let probe = null, probeSpec = null;
let recent = [];                // [{t, tokens, step_s}] of this session's steps: tok/s and ETA

// -- output ---------------------------------------------------------------------------------------------------
function log(message) {
  console.log(message);
  const el = $('#log');
  el.textContent = (el.textContent + message + '\n').split('\n').slice(-200).join('\n');
}

const fmtTime = (s) => (s == null ? '–' : s >= 3600 ? `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`
  : s >= 60 ? `${Math.floor(s / 60)} min ${Math.round(s % 60)} s` : `${s.toFixed(0)} s`);

function publish() {
  $('#status').textContent = JSON.stringify(status);
  $('#state').textContent = status.state + (status.error ? `: ${status.error}` : '');
  $('#state').className = status.state;
  $('#step').textContent = status.total_steps ? `${status.step} / ${status.total_steps}` : String(status.step);
  $('#loss').textContent = status.losses.length ? status.losses.at(-1).toFixed(4) : '–';
  $('#tps').textContent = status.tok_per_s == null ? '–' : status.tok_per_s.toFixed(1);
  $('#eta').textContent = fmtTime(status.eta_s);
  const g = status.gate;
  $('#battery').textContent = g ? `${g.state}: ${g.reason} (probe: ${g.probe})` : '–';
  $('#threads').textContent = `${status.threads ?? '?'} thread(s)${status.crossOriginIsolated ? '' : ' (not cross-origin isolated)'}`;
  drawLoss($('#plot'), status.losses, status.total_steps);
  const training = ['loading', 'training', 'gate-paused'].includes(status.state);
  $('#start').disabled = busy || !run || status.state === 'done';
  $('#start').textContent = run?.saved || status.step > 0 ? 'Resume' : 'Start';
  $('#pause').disabled = !training;
  $('#download').disabled = !(run && status.step > 0);
  $('#discard').disabled = busy || !run?.saved;
  $('#file').disabled = busy;
  const chatOff = busy || status.chat.busy || !bundle;
  $('#chat-input').disabled = chatOff;
  $('#chat-send').disabled = chatOff;
  $('#chat-reset').disabled = chatOff || !status.chat.history.length;
}

function setState(state, error = null) {
  status.state = state;
  status.error = error;
  if (state !== 'training') status.eta_s = state === 'done' ? 0 : null;
  publish();
}

function fail(e) {
  console.error(e);
  let msg = e?.message ?? String(e);
  if (e instanceof RunError && /was started with/.test(msg)) {
    msg += ' On this page: set the settings back, or press "Discard saved run" to start over.';
  }
  busy = false;
  setState('error', msg);
  log(`error: ${msg}`);
}

// -- data -----------------------------------------------------------------------------------------------------
async function fetchBytes(u) {
  const res = await fetch(u, { cache: 'no-store' });
  if (!res.ok) throw new Error(`${u}: HTTP ${res.status}`);
  return new Uint8Array(await res.arrayBuffer());
}

/** Take a training file (its name decides the format: .jsonl, .json, .txt) and find its saved run, if any. */
async function selectData(name, bytes) {
  setState('loading');
  tokenizer ??= TextTokenizer.fromFiles(await bundle.tokenizerFiles(), { dir: '/bundle/tokenizer' });
  const { examples, report } = loadExamples(name, bytes, tokenizer, bundle.manifest.seq_len);
  log(report.summary());
  const sha256 = await sha256Hex(bytes);
  const key = await runKey(bundle.sha256, sha256);
  const store = await OpfsRunStore.open(key, { onOpen, onStep });
  const saved = await store.loadConfig();
  run = { key, store, name, bytes, sha256, examples, report, saved };
  status.data = { name, bytes: bytes.length, sha256, examples: examples.length };
  status.run = key;
  $('#data-info').textContent = report.summary();
  form.set({ ...PAGE_DEFAULTS, ...(saved ?? {}), ...url.settings });
  form.lock(Boolean(saved));
  const { found, records } = await store.peek();
  status.step = found?.state.step ?? 0;
  status.total_steps = found?.state.total_steps ?? null;
  status.losses = records.map((r) => r.loss);
  status.resumed_from = null;
  if (saved) log(`saved run of ${name} on this bundle: step ${status.step}${status.total_steps ? `/${status.total_steps}` : ''}`);
  setState(found && found.state.step >= found.state.total_steps ? 'done' : saved ? 'paused' : 'idle');
  if (url.autostart && status.state !== 'done') start();
}

async function onFilePicked(event) {
  const file = event.target.files?.[0];
  if (!file || busy) return;
  try {
    await selectData(file.name, new Uint8Array(await file.arrayBuffer()));   // read here; never uploaded
  } catch (e) {
    fail(e);
  }
}

// -- the battery gate -----------------------------------------------------------------------------------------
// The runner reads the probe before every step and decides (src/gate, android_runner/gate.py); when it says
// pause or cool, the runner checkpoints and sleeps. The page shows that decision: the probe it hands the
// runner is this wrapper, which feeds the same readings to a second tracker (decide() is a pure function of
// reading, config and previous state, so it reaches the runner's states) and publishes them.
function pageProbe(inner, gateCfg) {
  const safe = new SafeProbe(inner, { warn: log });      // never throws: the runner's tracker and ours stay in step
  return {
    name: inner.name,
    chosen_because: inner.chosen_because,
    tracker: null,
    lastStepS: 0,
    reset() { this.tracker = new GateTracker(new GateConfig(gateCfg)); this.lastStepS = 0; },
    async read() {
      const reading = await safe.read();
      const d = this.tracker.update(reading, this.lastStepS);
      status.gate = { state: d.state, reason: d.reason, percent: reading.percent, charging: reading.charging,
        temp_c: reading.temp_c, probe: inner.name };
      if (d.run_step && status.state === 'gate-paused') setState('training');
      else publish();
      return reading;
    },
  };
}

async function gateSleep(seconds) {               // the runner's waits: gate pause/cool, and SLOW's duty cycle
  const waiting = [GateState.PAUSED, GateState.COOLING].includes(probe.tracker.state);
  if (waiting) setState('gate-paused');
  await interruptibleSleep(seconds, () => stopFlag !== null);
}

// -- training -------------------------------------------------------------------------------------------------
function settingsNow() {
  const cfg = { ...PAGE_DEFAULTS, ...form.get(), threads: url.settings.threads ?? 0, gate: url.gate };
  return { ...cfg, bundle: `sha256:${bundle.sha256}`, data: `sha256:${run.sha256}` };
}

function dataSource(cfg) {
  const order = dataOrder(run.examples, cfg.seed, cfg.micro_batch, cfg.group_by_length);
  return {
    report: run.report,
    microBatchesPerEpoch: order.stepsPerEpoch(),
    nextMicroBatch: () => collate(order.nextBatch()[0].map((i) => run.examples[i]), tokenizer.padId),
    state: () => order.stateDict(),
    loadState: (s) => order.loadStateDict(s),
  };
}

async function onOpen(step) {                  // the engine is up, the loop starts at `step`
  status.step = step;
  status.resumed_from = run.store.resumedFrom;
  status.losses = run.store.records.map((r) => r.loss);
  status.threads = ort.env.wasm.numThreads;
  if (status.resumed_from) log(`continuing from the checkpoint at step ${status.resumed_from}`);
  recent = [];
  setState('training');
}

async function onStep(record) {                // after each optimizer step
  probe.lastStepS = record.step_s;
  recent.push({ t: performance.now() / 1000, tokens: record.tokens, step_s: record.step_s });
  recent = recent.slice(-11);
  const window = recent.slice(-10);
  status.tok_per_s = Math.round((window.reduce((a, r) => a + r.tokens, 0) / window.reduce((a, r) => a + r.step_s, 0)) * 10) / 10;
  const perStep = recent.length > 1 ? (recent.at(-1).t - recent[0].t) / (recent.length - 1) : record.step_s;
  status.step = record.step;
  status.losses.push(record.loss);
  status.eta_s = Math.round(Math.max(0, status.total_steps - record.step) * perStep * 10) / 10;
  publish();
  return record;
}

async function start() {
  if (busy || !run) return;
  busy = true;
  stopFlag = null;
  try {
    const cfg = settingsNow();
    if (probe === null || probeSpec !== cfg.battery) {        // one probe per page: a replay keeps its clock
      probe = pageProbe(await makeProbe(cfg.battery, { log }), cfg.gate);
      probeSpec = cfg.battery;
    }
    probe.reset();
    const { store } = run;
    store.extraConfig = { data_name: run.name, data_file: await store.saveData(run.name, run.bytes) };
    await store.markCurrent(bundle.sha256);
    const source = dataSource(cfg);
    status.total_steps = cfg.max_steps ?? cfg.epochs * Math.max(1, Math.floor(source.microBatchesPerEpoch / cfg.accum));
    setState('loading');
    const summary = await navigator.locks.request(`pocketlora-run-${run.key}`, () => train(cfg, {
      ort, bundle, data: source, store, log, probe, sleep: gateSleep,
      shouldStop: () => stopFlag !== null, stopReason: () => stopFlag,
    }));
    run.saved = await store.loadConfig();
    status.step = summary.step;
    busy = false;
    form.lock(true);
    setState(summary.finished ? 'done' : 'paused');
  } catch (e) {
    fail(e);
  }
}

function pause() {
  stopFlag = 'pause';
  log('pausing: finishing the micro-batch and saving a checkpoint');
}

async function discard() {
  if (busy || !run) return;
  if (!url.autostart && !confirm(`Delete the saved run of ${run.name} (step ${status.step}) from this browser?`)) return;
  await run.store.remove();
  log(`deleted the saved run of ${run.name}`);
  await selectData(run.name, run.bytes);
}

// -- the adapter ----------------------------------------------------------------------------------------------
async function download() {
  try {
    const found = await run.store.latest(log);
    if (!found) throw new Error('no checkpoint yet');
    const { tensors } = readSafetensors(found.weights);
    const lora = new Map(bundle.manifest.trainable.map((t) => [t.onnx_name, tensors.get(t.onnx_name)?.data]));
    const files = peftFiles(bundle, lora);
    status.adapter = { step: found.state.step, files: {} };
    for (const [name, bytes] of Object.entries(files)) {
      status.adapter.files[name] = { bytes: bytes.length, sha256: await sha256Hex(bytes) };
      const a = document.createElement('a');
      a.href = URL.createObjectURL(new Blob([bytes], { type: 'application/octet-stream' }));
      a.download = name;
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(a.href), 60_000);
    }
    log(`adapter of step ${found.state.step}: adapter_config.json + adapter_model.safetensors (put both in one ` +
      'folder; PeftModel.from_pretrained(base_model, folder))');
  } catch (e) {
    status.adapter = { error: e?.message ?? String(e) };   // the run goes on
    log(`cannot make the adapter: ${status.adapter.error}`);
  }
  publish();
}

// -- the chat -------------------------------------------------------------------------------------------------
async function chatSend(text) {
  const chat = status.chat;
  if (busy || chat.busy || !text.trim()) return;
  chat.busy = true;
  chat.error = null;
  publish();
  const out = $('#chat-log');
  try {
    tokenizer ??= TextTokenizer.fromFiles(await bundle.tokenizerFiles(), { dir: '/bundle/tokenizer' });
    decoder ??= await Decoder.open(ort, bundle);
    const found = run ? await run.store.latest(log) : null;
    const tensors = found ? readSafetensors(found.weights).tensors : null;
    decoder.useAdapter(tensors ? new Map([...tensors].map(([n, t]) => [n, t.data])) : null);
    chat.adapter_step = found ? found.state.step : null;
    chat.history.push({ role: 'user', content: text });
    out.textContent += `you: ${text}\nmodel${found ? ` (step ${found.state.step})` : ' (base)'}: `;
    const ids = [];
    let shown = '';
    const t0 = performance.now();
    await generate(decoder, [tokenizer.generationPromptIds(chat.history)], { maxNewTokens: 64, temperature: 0 },
      turnEndIds(tokenizer), tokenizer.padId ?? 0, { onToken: (_b, id) => {
        ids.push(id);
        const text = tokenizer.decode(ids, true);
        if (!text.endsWith('\ufffd')) { out.textContent += text.slice(shown.length); shown = text; }
      } });
    const reply = tokenizer.decode(ids, true);
    out.textContent += reply.slice(shown.length) + '\n';
    chat.tok_per_s = Math.round((ids.length / ((performance.now() - t0) / 1000)) * 10) / 10;
    chat.history.push({ role: 'assistant', content: reply.trim(), token_ids: ids });
  } catch (e) {
    chat.error = e?.message ?? String(e);
    log(`chat: ${chat.error}`);
  }
  chat.busy = false;
  publish();
}

function chatReset() {
  status.chat.history = [];
  $('#chat-log').textContent = '';
  publish();
}

// -- start-up -------------------------------------------------------------------------------------------------
async function main() {
  form = settingsForm($('#settings'));
  form.set(PAGE_DEFAULTS);
  $('#file').addEventListener('change', onFilePicked);
  $('#start').addEventListener('click', () => start());
  $('#pause').addEventListener('click', pause);
  $('#download').addEventListener('click', download);
  $('#discard').addEventListener('click', discard);
  const send = () => { const t = $('#chat-input').value; $('#chat-input').value = ''; chatSend(t); };
  $('#chat-send').addEventListener('click', send);
  $('#chat-input').addEventListener('keydown', (e) => { if (e.key === 'Enter') send(); });
  $('#chat-reset').addEventListener('click', chatReset);
  globalThis.pocketloraChat = chatSend;         // for scripts and headless tests
  publish();
  try {
    if (!isSecureContext) {
      throw new Error('this page needs a secure context for its storage and threads: open it as http://localhost:PORT ' +
        '(on a phone: `adb reverse tcp:PORT tcp:PORT`, then localhost) or over https');
    }
    url = fromUrl(location.search);
    ort.env.wasm.wasmPaths = DIST;
    ort.env.wasm.numThreads = url.settings.threads || (crossOriginIsolated ? navigator.hardwareConcurrency : 1);
    ort.env.logLevel = 'error';
    status.threads = ort.env.wasm.numThreads;
    if (!crossOriginIsolated) log('warning: not cross-origin isolated, so WASM runs on one thread; serve with `pocketlora web`');
    bundle = await openBundle();
    const m = bundle.manifest;
    $('#bundle-info').textContent = `${m.model.architecture} (${m.family}, ${m.model.num_layers} layers, ` +
      `hidden ${m.model.hidden_size}), LoRA r=${m.lora.r} on ${m.lora.target_modules.join(', ')}, seq_len ${m.seq_len}`;
    form.set({ ...PAGE_DEFAULTS, ...url.settings });
    if (url.data) {
      const name = decodeURIComponent(new URL(url.data, location.href).pathname.split('/').at(-1));
      await selectData(name, await fetchBytes(url.data));
      return;
    }
    const cur = await currentRun();
    if (cur && cur.bundle_sha256 === bundle.sha256) {          // continue the last run without the file
      const store = await OpfsRunStore.open(cur.key);
      const saved = await store.loadConfig();
      const bytes = saved?.data_file ? await store.loadData(saved.data_file) : null;
      if (bytes) {
        await selectData(saved.data_name, bytes);
        return;
      }
    }
    setState('idle');
  } catch (e) {
    fail(e);
  }
}

main();

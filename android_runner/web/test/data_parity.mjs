// Runs the JS data pipeline (src/data) over a job file and writes what it produced, for
// tests/test_web_data.py to compare with ort_trainer's Python side.
//   node test/data_parity.mjs job.json out.json
// job: {tokenizers: {name: dir}, loads: [{id, tokenizer, path, seq_len}],
//       errors: [{id, tokenizer, name, data_b64, seq_len}], renders: [{id, tokenizer, messages, gen}],
//       orders: [{id, n, seed, batch_size, lengths, steps, resume_at, py_state}],
//       collates: [{id, tokenizer, path, seq_len, indices}], tokenizer_info: [name]}
import fs from "node:fs";
import { DataError, DataOrder, TextTokenizer, collate, loadExamples } from "../src/data/index.mjs";

const [jobPath, outPath] = process.argv.slice(2);
if (!jobPath || !outPath) {
  // `node --test test/` also picks this file up: without a job it has nothing to do.
  console.log("usage: node test/data_parity.mjs job.json out.json (driven by tests/test_web_data.py)");
  process.exit(0);
}
const job = JSON.parse(fs.readFileSync(jobPath, "utf8"));
const out = { loads: {}, errors: {}, renders: {}, orders: {}, collates: {}, tokenizer_info: {}, timings: {} };

const toks = {};
for (const [name, dir] of Object.entries(job.tokenizers)) {
  const t0 = performance.now();
  toks[name] = await TextTokenizer.fromDir(dir);
  out.timings[`load tokenizer ${name}`] = Math.round(performance.now() - t0);
}

for (const name of job.tokenizer_info ?? []) {
  const t = toks[name];
  out.tokenizer_info[name] = {
    bos_token: t.bosToken, eos_token: t.eosToken, pad_token: t.padToken, unk_token: t.unkToken,
    bos_id: t.bosId, eos_id: t.eosId, pad_id: t.padId, prefix_ids: t.prefixIds, suffix_ids: t.suffixIds,
    has_chat_template: t.hasChatTemplate, additional_special_tokens: t.additionalSpecialTokens,
  };
}

const plain = (r) => Object.fromEntries(Object.entries(r).filter(([, v]) => typeof v !== "function"));
const cache = new Map();
function load(spec) {
  const key = `${spec.tokenizer}|${spec.path}|${spec.seq_len}`;
  if (!cache.has(key)) {
    const t0 = performance.now();
    const res = loadExamples(spec.path, fs.readFileSync(spec.path), toks[spec.tokenizer], spec.seq_len);
    out.timings[`load ${key}`] = Math.round(performance.now() - t0);
    cache.set(key, res);
  }
  return cache.get(key);
}

for (const spec of job.loads ?? []) {
  try {
    const { examples, report } = load(spec);
    out.loads[spec.id] = {
      input_ids: examples.map((e) => Array.from(e.input_ids)),
      labels: examples.map((e) => Array.from(e.labels)),
      report: plain(report),
    };
  } catch (e) {
    if (!(e instanceof DataError)) throw e;
    out.loads[spec.id] = { error: e.message };
  }
}

for (const spec of job.errors ?? []) {
  try {
    const { examples, report } = loadExamples(spec.name, Buffer.from(spec.data_b64, "base64"), toks[spec.tokenizer], spec.seq_len);
    out.errors[spec.id] = { ok: true, examples: examples.length, report: plain(report),
      input_ids: examples.map((e) => Array.from(e.input_ids)), labels: examples.map((e) => Array.from(e.labels)) };
  } catch (e) {
    if (!(e instanceof DataError)) out.errors[spec.id] = { crash: `${e.name}: ${e.message}` };
    else out.errors[spec.id] = { error: e.message };
  }
}

for (const spec of job.renders ?? []) {
  try {
    out.renders[spec.id] = { text: toks[spec.tokenizer].renderChat(spec.messages, spec.gen) };
  } catch (e) {
    out.renders[spec.id] = { error: e.message };
  }
}

for (const spec of job.orders ?? []) {
  const t0 = performance.now();
  const mk = () => new DataOrder(spec.n, BigInt(spec.seed), spec.batch_size, spec.lengths ?? null);
  const order = mk();
  const seq = [];
  let state = null;
  for (let k = 0; k < spec.steps; k++) {
    if (k === spec.resume_at) state = order.stateDict();
    const [idx, epoch] = order.nextBatch();
    seq.push([idx, epoch]);
  }
  const resumed = mk();
  resumed.loadStateDict(state);
  const tail = [];
  for (let k = spec.resume_at; k < spec.steps; k++) tail.push(resumed.nextBatch());
  let pyTail = null;
  if (spec.py_state) {
    const fromPy = mk();
    fromPy.loadStateDict(spec.py_state);
    pyTail = [];
    for (let k = spec.resume_at; k < spec.steps; k++) pyTail.push(fromPy.nextBatch());
  }
  const s = state;
  out.orders[spec.id] = { seq, state: { ...s, seed: String(s.seed) }, tail, py_tail: pyTail,
    epoch_progress: order.epochProgress, steps_per_epoch: order.stepsPerEpoch() };
  out.timings[`order ${spec.id}`] = Math.round(performance.now() - t0);
}

for (const spec of job.collates ?? []) {
  const { examples } = load(spec);
  const b = collate(spec.indices.map((i) => examples[i]), toks[spec.tokenizer].padId);
  out.collates[spec.id] = { dims: b.dims, input_ids: Array.from(b.input_ids, Number),
    attention_mask: Array.from(b.attention_mask, Number), labels: Array.from(b.labels, Number) };
}

fs.writeFileSync(outPath, JSON.stringify(out));

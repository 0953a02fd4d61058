// Runs the JS battery gate (src/gate) over a job file and writes what it decided, for tests/test_web_gate.py to
// compare with android_runner/gate.py + probes.py on the same traces, configs and fake clock.
//   node test/gate_sim.mjs job.json out.json
// job: {sims: [{id, spec, config, initial, t_start, steps}],        replay spec through makeProbe, fake clock
//       termux: [{id, text}], configs: [{id, options}], loads: [{id, spec}]}
// Non-finite numbers travel as {"$float": "nan" | "inf" | "-inf"} both ways.
// Without arguments (e.g. under `node --test test/`) it does nothing.
import fs from 'node:fs';
import { GateConfig, GateTracker, TermuxProbe, makeProbe } from '../src/gate/index.mjs';

const [jobPath, outPath] = process.argv.slice(2);
if (!jobPath) {
  console.log('usage: node test/gate_sim.mjs job.json out.json');
  process.exit(0);
}

const FLOATS = { nan: NaN, inf: Infinity, '-inf': -Infinity };
const revive = (k, v) => (v && typeof v === 'object' && !Array.isArray(v) && '$float' in v ? FLOATS[v.$float] : v);
const replace = (k, v) => (typeof v === 'number' && !Number.isFinite(v)
  ? { $float: Number.isNaN(v) ? 'nan' : v > 0 ? 'inf' : '-inf' } : v);
const job = JSON.parse(fs.readFileSync(jobPath, 'utf8'), revive);
const out = { sims: {}, termux: {}, configs: {}, loads: {} };
const READING = ['percent', 'charging', 'temp_c', 'current_a', 'voltage_v', 'energy_wh', 'charge_ah', 'source'];
const fields = (r) => Object.fromEntries(READING.map((k) => [k, r[k]]));

// The runner's loop on a fake clock: a step takes steps[i % n] seconds (its finite positive part moves the clock),
// then the runner sleeps sleep_s; while paused/cooling it only sleeps. Same loop as simulate() in the Python test.
for (const sim of job.sims ?? []) {
  const clock = { t: sim.t_start };
  const now = () => clock.t;
  const probe = await makeProbe(sim.spec, { clock: now, log: () => {} });
  const tracker = new GateTracker(new GateConfig(sim.config), { initial: sim.initial, clock: now });
  const decisions = [];
  let i = 0;
  while (probe.elapsed() <= probe.duration_s) {
    const reading = await probe.read();
    const step = sim.steps[i % sim.steps.length];
    i += 1;
    const d = tracker.update(reading, step);
    decisions.push([clock.t, fields(reading), d.state, d.sleep_s, d.run_step, d.reason, d.changed]);
    const taken = Number.isFinite(step) && step > 0 ? step : 0.0;
    clock.t += (d.run_step ? taken : 0.0) + d.sleep_s;
  }
  tracker.finish();
  out.sims[sim.id] = { decisions, summary: tracker.summary(), seconds_in: tracker.seconds_in, state: tracker.state };
}

for (const { id, text } of job.termux ?? []) {
  try {
    out.termux[id] = { reading: fields(TermuxProbe.parse(text)) };
  } catch (e) {
    out.termux[id] = { error: e.message, type: e.name };
  }
}

for (const { id, options } of job.configs ?? []) {
  try {
    new GateConfig(options).validate();
    new GateTracker(options);
    out.configs[id] = null;
  } catch (e) {
    out.configs[id] = e.message;
  }
}

for (const { id, spec } of job.loads ?? []) {
  try {
    const p = await makeProbe(spec, { clock: () => 0, log: () => {} });
    out.loads[id] = { times: p.times, rows: p.rows.map(fields), speed: p.speed };
  } catch (e) {
    out.loads[id] = { error: e.message };
  }
}

fs.writeFileSync(outPath, JSON.stringify(out, replace));

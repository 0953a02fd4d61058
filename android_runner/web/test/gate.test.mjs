// The JS-only parts of the battery gate (src/gate): the browser probe, auto, SafeProbe, the termux command in Node,
// and that the modules load without any Node built-in (as in a browser page). The policy and the replay/termux
// parsing are compared with the Python gate by tests/test_web_gate.py (via test/gate_sim.mjs).
//   node --test test/gate.test.mjs
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import {
  BatteryReading, BrowserBatteryProbe, GateConfig, GateState, GateTracker, NoneProbe, ProbeError, ReplayProbe,
  SafeProbe, TermuxProbe, makeProbe, runCommand,
} from '../src/gate/index.mjs';

const WEB = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const TERMUX_JSON = '{"health":"GOOD","percentage":57,"plugged":"PLUGGED_USB","status":"CHARGING","temperature":30.1}';
const fakeNavigator = (level, charging) => ({ getBattery: async () => ({ level, charging }) });
const failing = (msg) => () => { throw new ProbeError(msg); };

test('browser probe: level * 100, charging, no temperature', async () => {
  const r = await new BrowserBatteryProbe({ navigator: fakeNavigator(0.57, false) }).read();
  assert.deepEqual({ ...r }, { ...new BatteryReading({ percent: 57, charging: false, source: 'browser' }) });
  assert.equal((await new BrowserBatteryProbe({ navigator: fakeNavigator(0.15, true) }).read()).percent, 15);
  assert.equal((await new BrowserBatteryProbe({ navigator: fakeNavigator(1, undefined) }).read()).charging, null);
  await assert.rejects(new BrowserBatteryProbe({ navigator: {} }).read(), /no Battery Status API/);
  const broken = { getBattery: async () => { throw new Error('NotAllowedError'); } };
  await assert.rejects(new BrowserBatteryProbe({ navigator: broken }).read(), /getBattery\(\) failed: NotAllowedError/);
});

test('the browser level is live: the BatteryManager is asked once and read each time', async () => {
  const battery = { level: 0.8, charging: false };
  let asked = 0;
  const probe = new BrowserBatteryProbe({ navigator: { getBattery: async () => { asked += 1; return battery; } } });
  assert.equal((await probe.read()).percent, 80);
  battery.level = 0.14;
  const r = await probe.read();
  assert.equal(r.percent, 14);
  assert.equal(asked, 1);
  const d = new GateTracker().update(r, 10);
  assert.equal(d.state, GateState.PAUSED);
  assert.equal(d.reason, 'battery 14% < pause-below 15% and not charging');
});

test('auto: browser, else termux, else none with a warning', async () => {
  const log = [];
  let p = await makeProbe('auto', { navigator: fakeNavigator(0.42, true), termuxRunner: () => TERMUX_JSON, log: (m) => log.push(m) });
  assert.ok(p instanceof BrowserBatteryProbe);
  assert.equal(p.chosen_because, 'auto: browser reads battery 42%');
  assert.deepEqual(log, ['battery probe: auto: browser reads battery 42%']);

  p = await makeProbe('auto', { navigator: undefined, termuxRunner: () => TERMUX_JSON, log: () => {} });
  assert.ok(p instanceof TermuxProbe);
  assert.equal(p.chosen_because,
    'auto: termux reads battery 57% (browser: no Battery Status API here (navigator.getBattery))');

  p = await makeProbe('auto', { navigator: fakeNavigator(NaN, false), termuxRunner: () => TERMUX_JSON, log: () => {} });
  assert.ok(p instanceof TermuxProbe);   // a browser without a level does not count
  assert.match(p.chosen_because, /\(browser: no battery percent\)$/);

  log.length = 0;
  p = await makeProbe('auto', { navigator: {}, termuxRunner: failing('termux-battery-status: command not found'),
    log: (m) => log.push(m) });
  assert.ok(p instanceof NoneProbe);
  assert.equal(p.chosen_because, 'auto: no probe works (browser: no Battery Status API here (navigator.getBattery); '
    + 'termux-battery-status: command not found)');
  assert.equal(log.length, 1);
  assert.match(log[0], /^WARNING: battery probe: auto: no probe works .*; running without battery\/thermal gating$/);
});

test('makeProbe: explicit specs and errors', async () => {
  assert.ok(await makeProbe(' none ') instanceof NoneProbe);
  assert.ok(await makeProbe('termux') instanceof TermuxProbe);
  const b = await makeProbe('browser', { navigator: fakeNavigator(0.5, false) });
  assert.ok(b instanceof BrowserBatteryProbe);
  assert.equal(b.chosen_because, "requested with 'browser'");
  await assert.rejects(makeProbe('battery'), { message: "unknown battery probe 'battery'; valid: auto, browser, termux, "
    + 'replay:PATH[@SPEED], none' });
  await assert.rejects(makeProbe('android-sysfs'), /Python runner's only/);
  await assert.rejects(makeProbe('replay:'), /replay needs a trace/);
  await assert.rejects(makeProbe('replay:x.csv@fast'), { message: "replay speed 'fast' is not a number: use "
    + 'replay:PATH@SPEED, e.g. @40' });
  await assert.rejects(makeProbe('replay:/no/such/trace.csv'), /cannot read replay trace \/no\/such\/trace.csv: ENOENT/);
  // A page replays a URL; readText may be injected (here instead of fetch).
  const p = await makeProbe('replay:https://host/app/traces/t.csv?v=1@60', {
    clock: () => 0, readText: async (url) => (url === 'https://host/app/traces/t.csv?v=1' ? 't_s,percent,charging,temp_c\n0,50,1,30\n' : ''),
  });
  assert.equal(p.speed, 60);
  assert.equal((await p.read()).source, 'replay:t.csv');
});

test('replay from text follows the clock', async () => {
  const clock = { t: 1000 };
  const p = new ReplayProbe('t_s,percent,charging,temp_c\n0,70,false,31\n60,69,no,\n120,68,,32\n', { clock: () => clock.t, speed: 2 });
  assert.equal(p.elapsed(), 0);
  assert.equal((await p.read()).percent, 70);
  clock.t += 29.99;
  assert.equal((await p.read()).percent, 70);
  clock.t += 0.01;
  const r = await p.read();
  assert.deepEqual([r.percent, r.charging, r.temp_c], [69, false, null]);
  clock.t += 1e6;
  assert.deepEqual([(await p.read()).percent, (await p.read()).charging], [68, null]);
  assert.throws(() => new ReplayProbe('t_s,percent,charging,temp_c\n0,1,1,1\n', { speed: 0 }), /replay speed must be > 0, got 0.0/);
});

test('SafeProbe degrades once, for good', async () => {
  let calls = 0;
  const flaky = { name: 'flaky', read: async () => { calls += 1; if (calls > 2) throw new ProbeError('sysfs went away'); return new BatteryReading({ percent: 50, source: 'flaky' }); } };
  const warnings = [];
  const p = new SafeProbe(flaky, { warn: (m) => warnings.push(m) });
  assert.equal((await p.read()).percent, 50);
  assert.equal((await p.read()).percent, 50);
  const r = await p.read();
  assert.deepEqual({ ...r }, { ...new BatteryReading({ source: 'none' }) });
  assert.equal((await p.read()).source, 'none');
  assert.equal(calls, 3);
  assert.ok(p.degraded);
  assert.deepEqual(warnings, ["battery probe 'flaky' failed (sysfs went away); continuing without battery/thermal gating"]);
  // An unknown reading is FULL ("no battery reading"): the run goes on.
  assert.equal(new GateTracker().update(r, 10).reason, 'no battery reading');
});

test('termux in Node: the command, its failures, an injected runner', async (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'gate-termux-'));
  t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
  const script = (name, body) => {
    const f = path.join(dir, name);
    fs.writeFileSync(f, `#!/bin/sh\n${body}\n`, { mode: 0o755 });
    return f;
  };
  script('termux-battery-status', `echo '${TERMUX_JSON}'`);
  const oldPath = process.env.PATH;
  process.env.PATH = `${dir}${path.delimiter}${oldPath}`;
  try {
    const r = await new TermuxProbe().read();               // the default runner finds it on PATH
    assert.deepEqual([r.percent, r.charging, r.temp_c, r.source], [57, true, 30.1, 'termux']);
  } finally {
    process.env.PATH = oldPath;
  }
  const fails = script('fails', 'echo "Termux:API is not installed" >&2; exit 3');
  await assert.rejects(runCommand([fails]), { name: 'ProbeError', message: `${fails}: exit code 3: Termux:API is not installed` });
  const hangs = script('hangs', 'exec sleep 5');
  await assert.rejects(runCommand([hangs], { timeoutS: 0.3 }), { message: `${hangs}: no answer within 0.3 s` });
  await assert.rejects(runCommand([path.join(dir, 'missing')]), { message: `${path.join(dir, 'missing')}: command not found` });
  await assert.rejects(new TermuxProbe({ runner: () => { throw new Error('denied'); } }).read(),
    { name: 'ProbeError', message: 'termux-battery-status: denied' });
  await assert.rejects(new TermuxProbe({ runner: async () => 'termux-api not installed' }).read(), /not JSON/);
});

test('config: defaults, unknown options, toJSON', () => {
  const c = new GateConfig();
  assert.deepEqual(c.toJSON(), { slow_below: 60, slow_factor: 0.5, pause_below: 15, resume_above: 30, max_temp: 42,
    cool_hysteresis: 3, poll_s: 30 });
  assert.equal(c.validate(), c);
  assert.throws(() => new GateConfig({ pause_belw: 10 }), /unknown gate option\(s\) pause_belw/);
  assert.throws(() => new GateTracker({ initial: 'full' }), /unknown gate option/);
  assert.throws(() => new GateTracker(null, { initial: 'FULL' }), /'FULL' is not a valid GateState/);
  assert.equal(new GateTracker({ pause_below: 20 }).cfg.pause_below, 20);
});

test('the modules load and run without Node built-ins (as in a browser)', (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'gate-browser-'));
  t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
  fs.writeFileSync(path.join(dir, 'hooks.mjs'), `
export async function resolve(specifier, context, next) {
  const r = await next(specifier, context);
  if (r.url.startsWith('node:') && context.parentURL && context.parentURL.includes('/src/gate/')) {
    throw new Error('src/gate imports ' + specifier + ' (from ' + context.parentURL + ')');
  }
  return r;
}`);
  fs.writeFileSync(path.join(dir, 'register.mjs'),
    `import { register } from 'node:module';\nregister(${JSON.stringify(new URL(`file://${path.join(dir, 'hooks.mjs')}`).href)});\n`);
  const script = `
const g = await import('./src/gate/index.mjs');
const nav = { getBattery: async () => ({ level: 0.1, charging: false }) };
const p = new g.SafeProbe(await g.makeProbe('auto', { navigator: nav, log: () => {} }));
const tracker = new g.GateTracker({}, { clock: () => 0 });
const d = tracker.update(await p.read(), 5);
const replay = await g.makeProbe('replay:https://x/t.csv@40', { clock: () => 0, readText: async () => 't_s,percent,charging,temp_c\\n0,50,1,43\\n' });
const d2 = tracker.update(await replay.read(), 5, 1);
console.log(JSON.stringify([d.state, d2.state, p.inner.name]));
let blocked = false;
try { await g.makeProbe('replay:trace.csv'); } catch (e) { blocked = /src\\/gate imports node:fs/.test(e.message); }
console.log(blocked);`;
  const out = execFileSync(process.execPath, ['--import', path.join(dir, 'register.mjs'), '--input-type=module', '-e', script],
    { cwd: WEB, encoding: 'utf8' }).trim().split('\n');
  assert.deepEqual(out, ['["paused","cooling","browser"]', 'true']);   // and the hook does catch a Node import
});

// Battery probes for the web runner: android_runner/probes.py's where they make sense in JS, same readings,
// same texts.
//
//   none                 NoneProbe: no battery information; the gate never throttles.
//   replay:PATH[@SPEED]  ReplayProbe: a recorded trace CSV (t_s,percent,charging,temp_c[,current_a,voltage_v]),
//                        parsed, stepped and fast-forwarded exactly as Python's ReplayProbe. PATH is a file (Node)
//                        or a URL (browser: fetched).
//   termux               TermuxProbe: `termux-battery-status` (Termux + Termux:API) run as a child process (Node).
//   browser              BrowserBatteryProbe: the Battery Status API, navigator.getBattery() (Chromium, Android
//                        WebView): level * 100 and charging; no temperature, so no thermal gating.
//   auto                 browser if navigator.getBattery exists and reads a percent, else termux if the command
//                        works, else none (with a warning through log).
//
// Every probe has a `name` and an async read() returning a BatteryReading (fields it cannot see are null) or
// rejecting with a ProbeError. SafeProbe turns a probe that breaks mid-run into "no reading" plus one warning.
// No static imports of Node modules: node:fs / node:child_process are imported lazily, only when running in Node,
// so these modules load unchanged in a browser.
import {
  codePointSlice, floatRepr, formatG, pyFloat, pyRepr, pyStr, pyStrip, pyTruthy,
} from './pyfmt.mjs';

export const COMMAND_TIMEOUT_S = 5.0;
export const SPECS = ['auto', 'browser', 'termux', 'replay:PATH[@SPEED]', 'none'];
const PYTHON_ONLY = ['android-sysfs', 'dumpsys', 'linux'];   // probes.py specs that need sysfs / adb

const monotonic = () => performance.now() / 1000;
const isNode = () => typeof process !== 'undefined' && Boolean(process.versions?.node);

/** The probe cannot read the battery here; the message says why. */
export class ProbeError extends Error {
  constructor(message) {
    super(message);
    this.name = 'ProbeError';
  }
}

/** One battery reading; Python's BatteryReading (null = unknown). */
export class BatteryReading {
  constructor({ percent = null, charging = null, temp_c = null, current_a = null, voltage_v = null, energy_wh = null,
    charge_ah = null, source = '' } = {}) {
    this.percent = percent;       // 0..100
    this.charging = charging;     // true / false / null
    this.temp_c = temp_c;         // battery temperature in Celsius
    this.current_a = current_a;   // instantaneous current (A), sign as the device reports it
    this.voltage_v = voltage_v;
    this.energy_wh = energy_wh;   // remaining energy if exposed
    this.charge_ah = charge_ah;   // remaining charge if exposed
    this.source = source;         // which probe produced it
    Object.freeze(this);
  }
}

// Python's max(0.0, p) / min(100.0, p): the first argument unless the second compares greater / smaller (so NaN -> 0).
const pyMax = (a, b) => (b > a ? b : a);
const pyMin = (a, b) => (b < a ? b : a);
const known = (x) => x !== null && x !== undefined;

function clampPercent(p) {
  return known(p) ? pyMin(100.0, pyMax(0.0, p)) : null;
}

/** float(value) * scale, or null when the value is missing or not a number (probes.py's _scaled). */
function scaled(value, scale) {
  if (!known(value) || typeof value === 'boolean') return null;
  try {
    return pyFloat(value) * scale;
  } catch {
    return null;
  }
}

async function callRunner(runner, what) {
  try {
    return await runner();
  } catch (e) {
    if (e instanceof ProbeError) throw e;
    throw new ProbeError(`${what}: ${e?.message ?? e}`);   // an injected runner may fail any way it likes
  }
}

/**
 * Run a command (Node) with a timeout and resolve to its stdout; any failure is a ProbeError with probes.py's
 * _run texts. In a browser it rejects: there are no commands to run.
 */
export async function runCommand(argv, { timeoutS = COMMAND_TIMEOUT_S } = {}) {
  if (!isNode()) throw new ProbeError(`${argv[0]}: cannot run commands in a browser`);
  const { execFile } = await import(/* webpackIgnore: true */ 'node:child_process');
  const { constants } = await import(/* webpackIgnore: true */ 'node:os');
  return new Promise((resolve, reject) => {
    execFile(argv[0], argv.slice(1), { timeout: timeoutS * 1000, encoding: 'utf8', windowsHide: true },
      (err, stdout, stderr) => {
        if (!err) return resolve(stdout);
        let msg;
        if (err.code === 'ENOENT') msg = 'command not found';
        else if (err.killed) msg = `no answer within ${formatG(timeoutS)} s`;
        else if (typeof err.code === 'number' || err.signal) {
          const rc = typeof err.code === 'number' ? err.code : -(constants.signals[err.signal] ?? 0);
          msg = `exit code ${rc}: ${pyStrip(stderr || '')}`;
        } else msg = err.message;
        return reject(new ProbeError(`${argv[0]}: ${msg}`));
      });
  });
}

// ------------------------------------------------------------------------------------------------------ termux

const PY_SPECIAL = '\u0000pyjson:';
const PY_SPECIAL_VALUES = { NaN: NaN, Infinity: Infinity, '-Infinity': -Infinity };

/** json.loads: JSON.parse plus Python's NaN, Infinity and -Infinity literals. */
function loadsJson(text) {
  try {
    return JSON.parse(text);
  } catch (e) {
    if (!/NaN|Infinity/.test(text)) throw e;
  }
  let out = '';
  let inString = false;
  for (let i = 0; i < text.length;) {
    const c = text[i];
    if (inString) {
      if (c === '\\') { out += text.slice(i, i + 2); i += 2; continue; }
      if (c === '"') inString = false;
      out += c; i += 1; continue;
    }
    if (c === '"') { inString = true; out += c; i += 1; continue; }
    const tok = ['-Infinity', 'Infinity', 'NaN'].find((t) => text.startsWith(t, i));
    if (tok) { out += JSON.stringify(PY_SPECIAL + tok); i += tok.length; continue; }
    out += c; i += 1;
  }
  const badKey = (v) => v && typeof v === 'object' &&
    Object.entries(v).some(([k, x]) => k.startsWith(PY_SPECIAL) || badKey(x));
  const data = JSON.parse(out, (k, v) => (typeof v === 'string' && v.startsWith(PY_SPECIAL)
    ? PY_SPECIAL_VALUES[v.slice(PY_SPECIAL.length)] : v));
  if (badKey(data)) throw new SyntaxError('NaN/Infinity as an object key');
  return data;
}

/**
 * `termux-battery-status` (Termux with the Termux:API app): JSON, `current` in µA, `voltage` in mV and
 * `charge_counter` in µAh where the version reports them. runner: () => string | Promise<string> (tests inject one).
 */
export class TermuxProbe {
  constructor({ runner = null } = {}) {
    this.name = 'termux';
    this.runner = runner ?? (() => runCommand(['termux-battery-status']));
  }

  /** probes.py TermuxProbe.parse: text -> BatteryReading, or a ProbeError. */
  static parse(text) {
    const shown = () => pyRepr(codePointSlice(pyStrip(text), 120));
    let data;
    try {
      data = loadsJson(text);
    } catch {
      throw new ProbeError(`termux-battery-status: not JSON: ${shown()}`);
    }
    if (!data || typeof data !== 'object' || Array.isArray(data) || !Object.hasOwn(data, 'percentage')) {
      throw new ProbeError(`termux-battery-status: no 'percentage' in ${shown()}`);
    }
    const text_ = (v) => (pyTruthy(v) ? pyStr(v).toUpperCase() : '');   // str(x or "").upper()
    const status = text_(data.status);
    const plugged = text_(data.plugged);
    let charging;
    if (status === 'CHARGING' || status === 'FULL') charging = true;
    else if (status === 'DISCHARGING' || status === 'NOT_CHARGING') charging = false;
    else if (plugged) charging = plugged !== 'UNPLUGGED';
    else charging = null;
    const charge = scaled(data.charge_counter, 1e-6);
    return new BatteryReading({
      percent: clampPercent(scaled(data.percentage, 1)), charging,
      temp_c: scaled(data.temperature, 1),
      current_a: scaled(data.current, 1e-6),
      voltage_v: scaled(data.voltage, 1e-3),
      charge_ah: charge !== null && charge > 0 ? charge : null,
      source: 'termux',
    });
  }

  async read() {
    return TermuxProbe.parse(await callRunner(this.runner, 'termux-battery-status'));
  }
}

// ----------------------------------------------------------------------------------------------------- browser

/**
 * The Battery Status API: navigator.getBattery() (Chromium-based browsers, Android WebView; not Firefox or
 * Safari). percent = level * 100 (rounded to 1e-6 so that level 0.57 reads 57, not 56.99999999999999),
 * charging as reported, no temperature.
 */
export class BrowserBatteryProbe {
  constructor({ navigator = globalThis.navigator } = {}) {
    this.name = 'browser';
    this.navigator = navigator;
    this._battery = null;
  }

  static available(navigator = globalThis.navigator) {
    return typeof navigator?.getBattery === 'function';
  }

  async read() {
    if (!BrowserBatteryProbe.available(this.navigator)) {
      throw new ProbeError('browser: no Battery Status API here (navigator.getBattery)');
    }
    if (this._battery === null) {
      try {
        this._battery = await this.navigator.getBattery();   // a live BatteryManager: ask once
      } catch (e) {
        throw new ProbeError(`browser: navigator.getBattery() failed: ${e?.message ?? e}`);
      }
    }
    const { level, charging } = this._battery;
    const percent = typeof level === 'number' && Number.isFinite(level) ? Math.round(level * 1e8) / 1e6 : null;
    return new BatteryReading({
      percent: clampPercent(percent), charging: typeof charging === 'boolean' ? charging : null, temp_c: null,
      source: 'browser',
    });
  }
}

// ------------------------------------------------------------------------------------------------ replay / none

function parseBool(text) {
  const t = pyStrip(text).toLowerCase();
  if (!t) return null;
  if (t === '1' || t === 'true' || t === 'yes') return true;
  if (t === '0' || t === 'false' || t === 'no') return false;
  throw new Error(`charging must be 1/0/true/false, got ${pyRepr(text)}`);
}

/**
 * Python's csv.reader (excel dialect, strict=False) over a file opened with newline='': lines end at \n, \r\n
 * or \r; a quoted field may span lines; a blank line is an empty row [].
 */
function csvRows(text) {
  const lines = text.match(/[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$/g) ?? [];
  const rows = [];
  const EOL = null;
  let fields = [], field = '', state = 'START_RECORD';
  const save = () => { fields.push(field); field = ''; };
  const feed = (c) => {
    const newline = c === '\n' || c === '\r';
    switch (state) {
      case 'START_RECORD':
        if (c === EOL) return;
        if (newline) { state = 'EAT_CRNL'; return; }
        state = 'START_FIELD';
      // falls through
      case 'START_FIELD':
        if (c === EOL || newline) { save(); state = c === EOL ? 'START_RECORD' : 'EAT_CRNL'; } else if (c === '"') state = 'IN_QUOTED_FIELD';
        else if (c === ',') save();
        else { field += c; state = 'IN_FIELD'; }
        return;
      case 'IN_FIELD':
        if (c === EOL || newline) { save(); state = c === EOL ? 'START_RECORD' : 'EAT_CRNL'; } else if (c === ',') { save(); state = 'START_FIELD'; } else field += c;
        return;
      case 'IN_QUOTED_FIELD':
        if (c === EOL) return;
        if (c === '"') state = 'QUOTE_IN_QUOTED_FIELD';
        else field += c;
        return;
      case 'QUOTE_IN_QUOTED_FIELD':
        if (c === '"') { field += c; state = 'IN_QUOTED_FIELD'; } else if (c === ',') { save(); state = 'START_FIELD'; } else if (c === EOL || newline) { save(); state = c === EOL ? 'START_RECORD' : 'EAT_CRNL'; } else { field += c; state = 'IN_FIELD'; }
        return;
      case 'EAT_CRNL':
        if (c === EOL) state = 'START_RECORD';
        return;
      default:
        throw new Error(`csv: bad state ${state}`);
    }
  };
  for (const line of lines) {
    for (const c of line) feed(c);
    feed(EOL);
    if (state === 'START_RECORD') { rows.push(fields); fields = []; }
  }
  if (field !== '' || state === 'IN_QUOTED_FIELD') { save(); rows.push(fields); }   // end of data inside a field
  return rows;
}

const isUrl = (p) => /^[a-z][a-z0-9+.-]*:\/\//i.test(p);

/** str(pathlib.Path(p)) for a POSIX path (URLs are left alone). */
function shownPath(p) {
  if (isUrl(p)) return p;
  const root = p.startsWith('/') ? (p.startsWith('//') && !p.startsWith('///') ? '//' : '/') : '';
  return (root + p.split('/').filter((x) => x && x !== '.').join('/')) || '.';
}

const baseName = (p) => (isUrl(p) ? p.replace(/[?#].*$/, '') : p).split('/').filter(Boolean).at(-1) ?? '';

const REQUIRED = ['t_s', 'percent', 'charging', 'temp_c'];

/** probes.py ReplayProbe._load over the file's text: [times, rows]. */
function loadTrace(text, path) {
  const rows = csvRows(text);
  const fieldnames = rows.length ? rows[0] : null;
  const missing = REQUIRED.filter((c) => !(fieldnames ?? []).includes(c));
  if (missing.length) {
    throw new Error(`${path}: missing column(s) ${missing.join(', ')}; header must start with ${REQUIRED.join(',')}`);
  }
  const times = [], readings = [];
  const source = `replay:${baseName(path)}`;
  let lineno = 1;
  for (const raw of rows.slice(1)) {
    if (raw.length === 0) continue;                    // csv.DictReader skips blank rows
    lineno += 1;
    const row = new Map();
    for (let j = 0; j < Math.min(raw.length, fieldnames.length); j++) row.set(fieldnames[j], raw[j]);
    for (let j = raw.length; j < fieldnames.length; j++) row.set(fieldnames[j], null);   // restval
    const num = (col) => {
      const v = pyStrip(row.get(col) || '');
      return v ? pyFloat(v) : null;
    };
    let t, reading;
    try {
      t = pyFloat(row.get('t_s'));
      reading = new BatteryReading({
        percent: num('percent'), charging: parseBool(row.get('charging') || ''), temp_c: num('temp_c'),
        current_a: num('current_a'), voltage_v: num('voltage_v'), source,
      });
    } catch (e) {
      throw new Error(`${path}:${lineno}: ${e.message}`);
    }
    if (times.length && t < times.at(-1)) {
      throw new Error(`${path}:${lineno}: t_s ${formatG(t)} goes backwards (previous ${formatG(times.at(-1))})`);
    }
    times.push(t);
    readings.push(reading);
  }
  if (!readings.length) throw new Error(`${path}: no data rows`);
  return [times, readings];
}

function checkSpeed(speed) {
  if (!(speed > 0)) throw new Error(`replay speed must be > 0, got ${typeof speed === 'number' ? floatRepr(speed) : pyRepr(speed)}`);
}

async function readTextFile(path) {
  try {
    if (isNode() && !isUrl(path)) {
      const fs = await import(/* webpackIgnore: true */ 'node:fs');
      return await fs.promises.readFile(path, 'utf8');
    }
    const res = await fetch(path);
    if (!res.ok) throw new Error(`HTTP ${res.status} ${res.statusText}`);
    return await res.text();
  } catch (e) {
    throw new Error(`cannot read replay trace ${path}: ${e?.message ?? e}`);
  }
}

/**
 * Replays a recorded trace: CSV t_s,percent,charging,temp_c[,current_a,voltage_v]. t_s counts seconds from the
 * first read(); a read returns the last row whose t_s is <= the elapsed time (the first row before that, the
 * last row after the end). speed fast-forwards: 60 replays a minute of trace per real second.
 * new ReplayProbe(csvText, {path, clock, speed}) parses text you have; ReplayProbe.open(path, ...) reads it.
 */
export class ReplayProbe {
  static REQUIRED = REQUIRED;

  constructor(text, { path = 'trace.csv', clock = monotonic, speed = 1.0 } = {}) {
    checkSpeed(speed);
    this.name = 'replay';
    this.path = shownPath(String(path));
    this.clock = clock;
    this.speed = Number(speed);
    [this.times, this.rows] = loadTrace(text, this.path);
    this._start = null;
  }

  /** Read the trace (Node: a file; browser: a URL, fetched; or readText(path) -> text) and build the probe. */
  static async open(path, { clock = monotonic, speed = 1.0, readText = readTextFile } = {}) {
    checkSpeed(speed);
    return new ReplayProbe(await readText(path), { path, clock, speed });
  }

  /** Trace time of the last row. */
  get duration_s() {
    return this.times.at(-1);
  }

  /** Trace seconds since the first read (0 before it). */
  elapsed() {
    if (this._start === null) return 0.0;
    return (this.clock() - this._start) * this.speed;
  }

  /** The reading now (synchronous; read() is the async probe interface). */
  readNow() {
    if (this._start === null) this._start = this.clock();
    const x = this.elapsed();
    let lo = 0, hi = this.times.length;                // bisect.bisect_right(times, x)
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (x < this.times[mid]) hi = mid;
      else lo = mid + 1;
    }
    return this.rows[Math.max(lo - 1, 0)];
  }

  async read() {
    return this.readNow();
  }
}

/** No battery information at all: the gate then never throttles. */
export class NoneProbe {
  constructor() {
    this.name = 'none';
  }

  async read() {
    return new BatteryReading({ source: 'none' });
  }
}

/**
 * Wraps a probe so that a failure mid-run warns once and then degrades to NoneProbe for good, instead of
 * taking the training run down. warn(message) defaults to console.warn.
 */
export class SafeProbe {
  constructor(probe, { warn = (m) => console.warn(m) } = {}) {
    this.inner = probe;
    this.warn = warn;
    this.name = probe.name;
    this.degraded = false;
    this._none = new NoneProbe();
  }

  async read() {
    if (this.degraded) return this._none.read();
    try {
      return await this.inner.read();
    } catch (e) {
      this.degraded = true;
      this.warn(`battery probe '${this.name}' failed (${e?.message ?? e}); continuing without battery/thermal gating`);
      return this._none.read();
    }
  }
}

// ----------------------------------------------------------------------------------------------------- factory

/**
 * Build a probe from auto|browser|termux|replay:PATH[@SPEED]|none (probes.py make_probe's strings; the sysfs and
 * dumpsys probes are the Python runner's). The probe carries chosen_because: why it was picked.
 * options: clock (seconds; replay), speed (replay, when the spec has no @SPEED), log (auto's choice and warning),
 * termuxRunner, navigator, readText (replay) — the last three let tests and pages inject their own.
 */
export async function makeProbe(spec, { clock = monotonic, speed = 1.0, log = (m) => console.log(m), termuxRunner = null,
  navigator = globalThis.navigator, readText = readTextFile } = {}) {
  spec = pyStrip(String(spec));
  const builders = {
    browser: () => new BrowserBatteryProbe({ navigator }),
    termux: () => new TermuxProbe({ runner: termuxRunner }),
    none: () => new NoneProbe(),
  };
  if (Object.hasOwn(builders, spec)) {
    const probe = builders[spec]();
    probe.chosen_because = `requested with '${spec}'`;
    return probe;
  }
  if (spec.startsWith('replay:')) {
    let path = spec.slice('replay:'.length);
    if (path.includes('@')) {                          // replay:TRACE.csv@40 fast-forwards 40x
      const at = path.lastIndexOf('@');
      const factor = path.slice(at + 1);
      path = path.slice(0, at);
      try {
        speed = pyFloat(factor);
      } catch {
        throw new Error(`replay speed ${pyRepr(factor)} is not a number: use replay:PATH@SPEED, e.g. @40`);
      }
    }
    if (!path) throw new Error('replay needs a trace: use replay:PATH/TO/trace.csv');
    const probe = await ReplayProbe.open(path, { clock, speed, readText });
    probe.chosen_because = `requested with '${spec}'`;
    return probe;
  }
  if (PYTHON_ONLY.includes(spec)) {
    throw new Error(`battery probe '${spec}' is the Python runner's only; the web runner has: ${SPECS.join(', ')}`);
  }
  if (spec !== 'auto') throw new Error(`unknown battery probe ${pyRepr(spec)}; valid: ${SPECS.join(', ')}`);

  const failures = [];
  for (const key of ['browser', 'termux']) {
    const probe = builders[key]();
    let reading;
    try {
      reading = await probe.read();
    } catch (e) {
      const msg = String(e?.message ?? e);
      failures.push(msg.startsWith(key) ? msg : `${key}: ${msg}`);
      continue;
    }
    if (!known(reading.percent)) {
      failures.push(`${key}: no battery percent`);
      continue;
    }
    const why = `auto: ${key} reads battery ${formatG(reading.percent)}%`;
    probe.chosen_because = why + (failures.length ? ` (${failures.join('; ')})` : '');
    log(`battery probe: ${probe.chosen_because}`);
    return probe;
  }
  const probe = new NoneProbe();
  probe.chosen_because = `auto: no probe works (${failures.join('; ')})`;
  log(`WARNING: battery probe: ${probe.chosen_because}; running without battery/thermal gating`);
  return probe;
}

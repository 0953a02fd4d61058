// The page's settings: `pocketlora train`'s flags and defaults (src/runner.mjs DEFAULTS, ort_trainer/settings.py),
// shown as a form and overridable from the URL (?max_steps=20&micro_batch=2&...&autostart=1), for automated runs.
import { DEFAULTS } from '../runner.mjs';
import { SCHEDULES } from '../schedule.mjs';
import { GATE_DEFAULTS } from '../gate/index.mjs';

// name, kind, label. Training settings first (a saved run keeps these), then how this device runs it.
export const FIELDS = [
  ['length', 'length', 'train for'],
  ['micro_batch', 'int', 'micro-batch (examples per forward pass)'],
  ['accum', 'int', 'accumulation (micro-batches per step)'],
  ['lr', 'float', 'learning rate'],
  ['warmup', 'int', 'warmup steps'],
  ['schedule', SCHEDULES, 'schedule'],
  ['clip', 'float', 'gradient clip (0: off)'],
  ['weight_decay', 'float', 'weight decay'],
  ['seed', 'int', 'seed (data order)'],
  ['group_by_length', 'bool', 'group examples by length'],
  ['save_every', 'int', 'checkpoint every N steps'],
  ['battery', 'text', 'battery probe (browser, none, replay:URL@SPEED)'],
];
export const PAGE_DEFAULTS = { ...DEFAULTS, epochs: 1, max_steps: null, battery: 'browser', threads: 0 };
const PARAMS = ['max_steps', 'epochs', 'micro_batch', 'accum', 'lr', 'warmup', 'schedule', 'clip', 'weight_decay', 'seed',
  'group_by_length', 'save_every', 'battery', 'threads'];

export class SettingsError extends Error {}

function parseValue(name, kind, text) {
  if (kind === 'bool') {
    const t = String(text).trim().toLowerCase();
    if (['1', 'true', 'yes', 'on', ''].includes(t)) return true;
    if (['0', 'false', 'no', 'off'].includes(t)) return false;
    throw new SettingsError(`${name}: not a yes/no value: '${text}'`);
  }
  if (kind === 'int' || kind === 'float') {
    const v = Number(text);
    if (String(text).trim() === '' || !Number.isFinite(v) || (kind === 'int' && !Number.isInteger(v))) {
      throw new SettingsError(`${name}: invalid ${kind} value: '${text}'`);
    }
    return v;
  }
  if (Array.isArray(kind) && !kind.includes(text)) throw new SettingsError(`${name}: use one of ${kind.join(', ')}, not '${text}'`);
  return text;
}

const KINDS = {
  ...Object.fromEntries(FIELDS.map(([n, k]) => [n, k])), max_steps: 'int', epochs: 'int', threads: 'int',
  ...Object.fromEntries(Object.keys(GATE_DEFAULTS).map((k) => [k, 'float'])),
};

/**
 * The URL's settings: {settings: {...}, gate: {...}, data, autostart}. Only what the URL names; unknown
 * parameters are an error (a typo must not silently train with a default).
 */
export function fromUrl(search) {
  const q = new URLSearchParams(search);
  const settings = {}, gate = {};
  let data = null, autostart = false;
  for (const [name, text] of q) {
    if (name === 'data') data = text;
    else if (name === 'autostart') autostart = parseValue(name, 'bool', text);
    else if (PARAMS.includes(name)) settings[name] = parseValue(name, KINDS[name], text);
    else if (name in GATE_DEFAULTS) gate[name] = parseValue(name, 'float', text);
    else throw new SettingsError(`unknown URL parameter '${name}'; known: data, autostart, ${PARAMS.join(', ')}, ${Object.keys(GATE_DEFAULTS).join(', ')}`);
  }
  if (settings.max_steps !== undefined && settings.epochs !== undefined) throw new SettingsError('give max_steps or epochs, not both');
  if (settings.max_steps !== undefined) settings.epochs = null;
  else if (settings.epochs !== undefined) settings.max_steps = null;
  return { settings, gate, data, autostart };
}

/** Build the form's inputs into `fieldset`; returns {get(), set(values), lock(bool)}. */
export function settingsForm(fieldset) {
  const inputs = {};
  for (const [name, kind, label] of FIELDS) {
    const row = document.createElement('label');
    row.textContent = label + ' ';
    if (kind === 'length') {
      const n = document.createElement('input');
      n.type = 'number'; n.min = '1'; n.step = '1'; n.name = 'length_n';
      const unit = document.createElement('select');
      unit.name = 'length_unit';
      for (const u of ['epochs', 'max_steps']) unit.add(new Option(u === 'epochs' ? 'epochs' : 'steps', u));
      const both = document.createElement('span');
      both.append(n, ' ', unit);
      row.append(both);
      inputs.length_n = n; inputs.length_unit = unit;
    } else {
      let el;
      if (Array.isArray(kind)) {
        el = document.createElement('select');
        for (const s of kind) el.add(new Option(s, s));
      } else {
        el = document.createElement('input');
        el.type = kind === 'bool' ? 'checkbox' : kind === 'text' ? 'text' : 'number';
        if (kind === 'float') el.step = 'any';
        if (kind === 'int') el.step = '1';
      }
      el.name = name;
      row.append(el);
      inputs[name] = el;
    }
    fieldset.append(row);
  }
  return {
    set(values) {
      for (const [name, kind] of FIELDS) {
        if (kind === 'length') {
          const unit = values.max_steps != null ? 'max_steps' : 'epochs';
          inputs.length_unit.value = unit;
          inputs.length_n.value = String(values[unit] ?? 1);
        } else if (kind === 'bool') inputs[name].checked = Boolean(values[name]);
        else inputs[name].value = values[name] == null ? (name === 'clip' ? '0' : '') : String(values[name]);
      }
    },
    get() {
      const out = {};
      for (const [name, kind] of FIELDS) {
        if (kind === 'length') {
          const unit = inputs.length_unit.value;
          out.epochs = null; out.max_steps = null;
          out[unit] = parseValue(unit, 'int', inputs.length_n.value);
        } else if (kind === 'bool') out[name] = inputs[name].checked;
        else out[name] = parseValue(name, kind, inputs[name].value);
      }
      return out;
    },
    lock(locked) {
      for (const el of Object.values(inputs)) if (el.name !== 'battery') el.disabled = locked;
    },
  };
}

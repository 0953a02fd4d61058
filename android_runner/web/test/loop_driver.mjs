// Runs the Node CLI's `train` (cli.mjs main, the same code path as the command line) with the replay probe on a
// clock that advances `tick` seconds per call instead of with wall time, so that every loop iteration's battery
// reading is fixed by the trace alone: the gate states per step and the checkpoints made on pause are then a
// function of the loop's semantics only, and tests/test_web_loop.py compares them with android_runner/loop.py
// run on the same clock. Records every checkpoint the run makes (step, reason); the run keeps only the newest 2.
//   node test/loop_driver.mjs job.json
// job: {argv: [...cli args after `train`...], tick: seconds per clock call, poll_s: the gate's wait while
//       paused/cooling (the CLI has no flag for it; 30 s by default), saves: output JSON path}
// Without arguments (e.g. under `node --test test/`) it does nothing.
import fs from 'node:fs';

import { main } from '../cli.mjs';

const [jobPath] = process.argv.slice(2);
if (!jobPath) {
  console.log('usage: node test/loop_driver.mjs job.json');
  process.exit(0);
}
const job = JSON.parse(fs.readFileSync(jobPath, 'utf8'));
let calls = 0;
const clock = () => (calls++) * job.tick;
const saves = [];
const wrapStore = (store) => {
  const save = store.save.bind(store);
  store.save = async (step, weights, record) => {
    saves.push({ step, reason: record.reason });
    return save(step, weights, record);
  };
  return store;
};
const code = await main(['train', ...job.argv], { probeOptions: { clock }, gate: { poll_s: job.poll_s }, wrapStore });
fs.writeFileSync(job.saves, JSON.stringify(saves));
process.exit(code);

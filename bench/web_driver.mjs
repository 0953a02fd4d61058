// The web runner's `train` command with extra InferenceSession options, for bench/web_vs_native.py's variants:
//   node bench/web_driver.mjs SESSION_OPTIONS_JSON train --bundle B --data D --out R ...   (cli.mjs's flags)
// e.g. '{"extra":{"session":{"disable_prepacking":"0"}}}' turns the frozen MatMul weights' prepacking back on.
import { main } from '../android_runner/web/cli.mjs';

const [options, ...argv] = process.argv.slice(2);
main(argv, { sessionOptions: JSON.parse(options) }).then((code) => process.exit(code), (e) => {
  console.error(e);
  process.exit(1);
});

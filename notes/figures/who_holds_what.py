"""Who holds what: the traced step of each stage, as a page with a slider.

    python notes/figures/who_holds_what.py      # writes notes/figures/who_holds_what.html

The data are the committed traces, trace_stage1.txt to trace_stage3.txt (``python -m zero
trace --stage N``, a real run on 2 gloo ranks, which tests/zerolab/test_trace.py holds to a fresh
one): for every event, the parameter and gradient bytes rank 0 holds just after it, and the
units whose full parameters exist. The page draws them, one frame per event: for each rank,
each unit as a box of N shards, this rank's own always held and the others filled while the
unit's full parameters exist, and two bars for the bytes. The trace is rank 0's; every rank
gathers and frees the same units at the same events (the collectives are symmetric), so
rank r is drawn from it with its own shard r. It is one file with
no network access: open it in any browser. tests/notes/test_notes.py rebuilds it and compares.
"""

import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
ROW = re.compile(r"^ *([\d.]+)  (\S*) +(.*?) +(\d+) +(\d+)  (.+)$")


def frames(stage: int) -> dict:
    """One stage's trace as data: its units and sizes, and a frame per event with bytes."""
    text = open(os.path.join(HERE, f"trace_stage{stage}.txt")).read()
    units = re.search(r"Units, padded numel \(fp32\): (.*?)\. AdamW", text).group(1)
    units = [(name, int(numel)) for name, numel in (u.rsplit(" ", 1) for u in units.split(", "))]
    names = [name for name, _ in units]
    out = []
    for line in text.splitlines():
        m = ROW.match(line)
        if m is None:
            continue
        ms, unit, event, params, grads, full = m.groups()
        full = names if full == "all" else [] if full == "none" else full.split(", ")
        out.append(dict(ms=float(ms), unit=unit, event=event.strip(), params=int(params),
                        grads=int(grads), full=full))
    sent = re.search(r"= ([\d.]+) R", text).group(1)
    n = int(re.search(r"on (\d+) gloo ranks", text).group(1))
    return dict(stage=stage, units=units, frames=out, sent=sent, n=n)


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>zero: who holds what</title>
<style>
body { font: 14px sans-serif; margin: 2em; max-width: 60em; }
.unit { display: inline-block; border: 2px solid #345; margin: 0 .4em; padding: .6em 1em; }
.shard { display: inline-block; border: 1px solid #345; margin: 1px; width: 2.6em;
         text-align: center; }
.shard.own { background: #345; color: white; }
.shard.full { background: #5a8dee; color: white; }
.bar { height: 1.2em; background: #5a8dee; display: inline-block; vertical-align: middle; }
.bar.g { background: #e07b39; }
td { padding: .2em .6em; } input[type=range] { width: 100%; }
</style></head><body>
<h1>Who holds what, event by event</h1>
<p>One training step of a GPT (2 blocks and a root) on 2 gloo ranks, rank 0's view, from the
committed traces (<code>python -m zerolab trace --stage N</code>). Each unit is a box of its N
shards: the rank's own shard (dark) it always holds; the others (light) it holds while the
unit's full parameters exist. The trace is rank 0's; rank 1 gathers and frees the same units
at the same events, so it is drawn from the same trace with its own shard. The bars are the
bytes of parameters (full parameters and shards) and of gradients rank 0 holds just after the
event; the rows "frees its full parameters" and "full gradient freed" are the instants the
rank gives memory back.</p>
<p>Stage: <select id="stage"></select> &nbsp; <button id="play">play</button></p>
<input type="range" id="slider" min="0" value="0">
<p id="event"></p>
<div id="units"></div>
<table>
<tr><td>parameters</td><td><span class="bar" id="pbar"></span> <span id="p"></span></td></tr>
<tr><td>gradients</td><td><span class="bar g" id="gbar"></span> <span id="g"></span></td></tr>
</table>
<p id="sent"></p>
<script>
const DATA = DATA_JSON;
const stage = document.getElementById("stage"), slider = document.getElementById("slider");
DATA.forEach((d, i) => stage.add(new Option("ZeRO-" + d.stage, i)));
const most = Math.max(...DATA.flatMap(d => d.frames.map(f => Math.max(f.params, f.grads))));
function draw() {
  const d = DATA[stage.value], f = d.frames[slider.value];
  slider.max = d.frames.length - 1;
  document.getElementById("event").textContent =
    "event " + (+slider.value + 1) + " of " + d.frames.length + ": " +
    (f.unit ? f.unit + ", " : "") + f.event;
  const ranks = [...Array(d.n).keys()];
  document.getElementById("units").innerHTML = ranks.map(r => "<p>rank " + r + ": " +
    d.units.map(([name, numel]) => '<span class="unit">' + name + "<br>" + ranks.map(s =>
      '<span class="shard' + (s == r ? " own" : f.full.includes(name) ? " full" : "") + '">' +
      s + "</span>").join("") + "<br><small>" + 4 * numel / d.n + " B a shard</small></span>"
    ).join("") + "</p>").join("");
  for (const [key, bar] of [["params", "p"], ["grads", "g"]]) {
    document.getElementById(bar + "bar").style.width = (30 * f[key] / most) + "em";
    document.getElementById(bar).textContent = f[key] + " B";
  }
  document.getElementById("sent").textContent = "This step sends " + d.sent +
    " R (R = 4 bytes x parameters x (N-1)/N, what one all-gather of every parameter sends).";
}
stage.onchange = () => { slider.value = 0; draw(); };
slider.oninput = draw;
let timer = null;
document.getElementById("play").onclick = () => {
  if (timer) { clearInterval(timer); timer = null; return; }
  timer = setInterval(() => {
    const d = DATA[stage.value];
    slider.value = (+slider.value + 1) % d.frames.length; draw();
  }, 400);
};
draw();
</script></body></html>
"""


def page() -> str:
    """The page, with every stage's frames in it as JSON."""
    data = json.dumps([frames(stage) for stage in (1, 2, 3)], ensure_ascii=False)
    return PAGE.replace("DATA_JSON", data)


def main() -> None:
    path = os.path.join(HERE, "who_holds_what.html")
    open(path, "w").write(page())
    print(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()

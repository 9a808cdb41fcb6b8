//! `kvmesh analyze`.

use crate::cli::AnalyzeArgs;
use anyhow::{bail, Context};
use kvmesh_sim::analyze::analyze;
use kvmesh_sim::trace;
use kvmesh_sim::workload::Workload;

/// Lines of skipped-line detail printed before summarising the rest.
const SHOW_SKIPPED: usize = 10;

pub fn run(args: &AnalyzeArgs) -> anyhow::Result<()> {
    let (trace, source) = match &args.trace {
        Some(path) => {
            let t = trace::load(path).with_context(|| format!("analyzing {}", path.display()))?;
            (t, path.display().to_string())
        }
        None => {
            let (w, what) = match args.workload.as_str() {
                "chat" => (Workload::default(), "generated multi-turn chat"),
                "conversation" => (Workload::conversation(), "generated, fitted to the Mooncake conversation trace"),
                other => bail!("unknown --workload {other:?}: use chat or conversation"),
            };
            eprintln!(
                "no --trace given: analyzing the built-in generated workload ({} multi-turn sessions, seed {}).\n\
                 For real traffic: kvmesh analyze --trace ../shared/traces/mooncake/conversation_trace.jsonl\n",
                w.sessions, w.seed
            );
            (w.generate(), format!("built-in workload `{}` ({what}, 512-token block ids)", args.workload))
        }
    };
    for e in trace.skipped.iter().take(SHOW_SKIPPED) {
        eprintln!("warning: skipped {source} {e}");
    }
    if trace.skipped.len() > SHOW_SKIPPED {
        eprintln!("warning: … and {} more malformed lines", trace.skipped.len() - SHOW_SKIPPED);
    }
    if args.strict && !trace.skipped.is_empty() {
        bail!("{} malformed lines in {source} (--strict)", trace.skipped.len());
    }
    let stats = analyze(&trace, args.top);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&stats)?);
    } else {
        print!("{}", stats.render(&source));
    }
    Ok(())
}

//! `kvmesh analyze`.

use crate::cli::AnalyzeArgs;
use anyhow::{bail, Context};
use kvmesh_sim::analyze::{advise_pd, analyze, PdAdvice, PdTarget};
use kvmesh_sim::engine::EngineProfile;
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
    let advice = pd_advice(args, &trace)?;
    if args.json {
        let mut v = serde_json::to_value(&stats)?;
        v["pd_advice"] = serde_json::to_value(advice)?;
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", stats.render(&source));
        if let Some(a) = advice {
            print!("{}", render_advice(&a, args));
        }
    }
    Ok(())
}

/// The prefill:decode split for `trace` (`--gpus` 0, or a trace without a rate: none).
fn pd_advice(args: &AnalyzeArgs, trace: &kvmesh_sim::trace::Trace) -> anyhow::Result<Option<PdAdvice>> {
    if args.gpus == 0 {
        return Ok(None);
    }
    if args.gpus == 1 {
        bail!("--gpus: a split needs at least 2 replicas (or 0 for no advice)");
    }
    if !(args.ttft_slo.is_finite() && args.ttft_slo > 0.0) {
        bail!("--ttft-slo must be a positive number of seconds, got {}", args.ttft_slo);
    }
    if let Some(t) = args.tpot_slo.filter(|t| !(t.is_finite() && *t > 0.0)) {
        bail!("--tpot-slo must be a positive number of seconds, got {t}");
    }
    if !(args.link_gbps.is_finite() && args.link_gbps > 0.0) {
        bail!("--link-gbps must be a positive number, got {}", args.link_gbps);
    }
    let profile = EngineProfile::resolve(&args.profile).map_err(anyhow::Error::msg)?;
    let target = PdTarget {
        gpus: args.gpus,
        ttft_slo_s: args.ttft_slo,
        tpot_slo_s: args.tpot_slo,
        block_size: 16,
        link_gbps: args.link_gbps,
    };
    Ok(advise_pd(trace, &profile, &target))
}

fn render_advice(a: &PdAdvice, args: &AnalyzeArgs) -> String {
    let tpot = args.tpot_slo.map_or(String::new(), |t| format!(", TPOT SLO {:.1} ms", t * 1e3));
    if !a.slo_reachable {
        return format!(
            "{:<17}{}:{} of {} {} replicas by work alone: the TTFT SLO ({} s) is below the slowest prompts' prefill and \
             KV transfer even on an idle fleet ({:.1} ms p99 at {} Gb/s); raise --ttft-slo or --link-gbps, or serve \
             aggregated\n",
            "P:D advice", a.prefill, a.decode, a.gpus, args.profile, args.ttft_slo, a.handoff_s_p99 * 1e3, args.link_gbps
        );
    }
    format!(
        "{:<17}{}:{} of {} {} replicas (TTFT SLO {} s{tpot}; check with `kvmesh replay --pd {}:{} --pd-link-gbps {} \
         --ttft-slo {}`)\n\
         {:<17}prefill {:.1} ms mean / {:.1} ms p99 uncached, {:.1} ms p99 with the KV transfer; prefill replicas at \
         most {:.0} % busy for the TTFT SLO; decode batch {}, {:.1} GPU-µs per output token; at the trace's rate \
         {:.2} prefill and {:.2} decode replicas are busy; this split carries up to {:.1}× the rate\n",
        "P:D advice",
        a.prefill,
        a.decode,
        a.gpus,
        args.profile,
        args.ttft_slo,
        a.prefill,
        a.decode,
        args.link_gbps,
        args.ttft_slo,
        "",
        a.prefill_s_mean * 1e3,
        a.prefill_s_p99 * 1e3,
        a.handoff_s_p99 * 1e3,
        a.prefill_utilisation * 100.0,
        a.decode_batch,
        a.decode_s_per_token * 1e6,
        a.prefill_replicas_needed,
        a.decode_replicas_needed,
        a.max_rate_scale
    )
}

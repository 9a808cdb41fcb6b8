//! `kvmesh`: the command line of the kvmesh LLM router.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod analyze;
mod autoscaler;
mod cli;
mod cluster;
mod connect;
mod demo;
mod loadtest;
mod node;
mod replay;
mod replica;
mod replication;
mod status;
mod table;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let result = match cli.command {
        cli::Command::Demo(args) => demo::run(&args),
        cli::Command::Analyze(args) => analyze::run(&args),
        cli::Command::Replay(args) => replay::run(&args),
        cli::Command::Node(args) => node::run(&args),
        cli::Command::Loadtest(args) => loadtest::run(&args),
        cli::Command::Status(args) => status::run(&args),
        cli::Command::Cluster(cmd) => cluster::run(&cmd),
        cli::Command::Replica(cmd) => replica::run(&cmd),
        cli::Command::Replication(cmd) => replication::run(&cmd),
        cli::Command::Autoscaler(cmd) => autoscaler::run(&cmd),
        cli::Command::Policies => {
            cli::print_policies();
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            // Layers often repeat the one below's text ("tcp connect error" twice): once is enough.
            let mut last = e.to_string();
            for cause in e.chain().skip(1).map(|c| c.to_string()) {
                if cause != last {
                    eprintln!("  caused by: {cause}");
                }
                last = cause;
            }
            if let Some(hint) = hint(&e) {
                eprintln!("  hint: {hint}");
            }
            // As timeout(1): clap's usage errors already exit 2.
            if e.downcast_ref::<replica::TimedOut>().is_some() {
                return ExitCode::from(124);
            }
            ExitCode::FAILURE
        }
    }
}

/// Writes `text` to stdout; a reader that went away (`kvmesh status | head`) ends the output
/// quietly instead of failing it.
pub(crate) fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

/// A hint for errors whose cause the message hides.
fn hint(e: &anyhow::Error) -> Option<&'static str> {
    if e.chain().any(|c| c.to_string().contains("the node does not know this call")) {
        return Some(
            "upgrade every node to this version; meanwhile `kvmesh replica undrain` puts a starting replica \
             into rotation on older nodes",
        );
    }
    // tonic's words for an answer that is plain HTTP, not gRPC: the node's OpenAI port.
    let http_not_grpc = e.chain().any(|c| c.to_string().contains("grpc-status header missing"));
    http_not_grpc.then_some(
        "that address answered plain HTTP, not gRPC: is it the node's HTTP port? --grpc takes its gRPC address \
         (node.grpc, 127.0.0.1:50051 by default)",
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_http_port_given_for_grpc_gets_a_hint() {
        let status = tonic::Status::unimplemented("grpc-status header missing, mapped from HTTP status code 404");
        let e = anyhow::Error::new(status).context("Admin.ListReplicas");
        assert!(super::hint(&e).is_some_and(|h| h.starts_with("that address answered plain HTTP")));
        assert_eq!(super::hint(&anyhow::anyhow!("connection refused")), None);
    }
}

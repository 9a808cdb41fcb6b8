//! `kvmesh`: the command line of the kvmesh LLM router.

#![forbid(unsafe_code)]

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
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::FAILURE
        }
    }
}

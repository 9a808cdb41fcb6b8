//! The replica actor: owns one replica's event subscription (and its stream record,
//! [`crate::state::Stream`]) and its metrics scraper (and its health record,
//! [`crate::state::Health`]).

use super::apply::Target;
use super::ingest::{self, Source};
use super::{adapters, scrape};
use crate::config::ReplicaConfig;
use crate::state::Shared;
use futures_util::FutureExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use tokio::task::JoinHandle;

/// One replica's actor.
pub struct ReplicaActor;

/// What the actor starts from.
pub struct ReplicaArgs {
    /// The node's state.
    pub shared: Arc<Shared>,
    /// The replica.
    pub config: ReplicaConfig,
}

/// Messages to a replica actor.
#[derive(Debug)]
pub enum ReplicaMsg {
    /// One of its tasks ended (it should not): fail, so the supervisor restarts the actor.
    TaskEnded(&'static str, String),
}

/// The actor's tasks, aborted when it stops.
pub struct ReplicaTasks {
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for ReplicaTasks {
    /// A killed actor skips `post_stop` (ractor), so the tasks also end with the state.
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Actor for ReplicaActor {
    type Msg = ReplicaMsg;
    type State = ReplicaTasks;
    type Arguments = ReplicaArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ReplicaMsg>,
        args: ReplicaArgs,
    ) -> Result<ReplicaTasks, ActorProcessingErr> {
        let (interval, replay_timeout) = {
            let c = args.shared.config.lock().unwrap_or_else(|p| p.into_inner());
            (c.node.scrape_interval, c.node.replay_timeout)
        };
        let mut tasks = Vec::new();
        // The replica as registered now: its stream and health records are this actor's to keep.
        let target = args
            .shared
            .core()
            .replicas
            .get(&args.config.name)
            .map(Target::of)
            .ok_or_else(|| format!("replica {:?} is not registered", args.config.name))?;
        if let Some(endpoint) = args.config.kv_events.clone() {
            let source = Source {
                name: args.config.name.clone(),
                endpoint,
                bind: args.config.kv_events_bind,
                replay: args.config.replay.clone(),
                replay_timeout,
                target: target.clone(),
            };
            let (shared, me) = (args.shared.clone(), myself.clone());
            tasks.push(tokio::spawn(async move {
                // A panic (a bug) ends the task like an error does: the actor fails and the
                // supervisor restarts it, instead of the replica silently going unfollowed.
                let why = match AssertUnwindSafe(ingest::run(shared, source)).catch_unwind().await {
                    Ok(Ok(())) => "ended".to_string(),
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "panicked".to_string(),
                };
                let _ = me.cast(ReplicaMsg::TaskEnded("kv_events", why));
            }));
        }
        let (shared, me, name, url) =
            (args.shared.clone(), myself.clone(), args.config.name.clone(), args.config.metrics());
        let rank = args.config.data_parallel_rank;
        tasks.push(tokio::spawn(async move {
            let run = scrape::run(shared, name, target, (url, rank), interval);
            let why = match AssertUnwindSafe(run).catch_unwind().await {
                Ok(()) => "ended",
                Err(_) => "panicked",
            };
            let _ = me.cast(ReplicaMsg::TaskEnded("scrape", why.into()));
        }));
        if args.config.lora_adapters.is_none() {
            let (shared, me, name) = (args.shared.clone(), myself.clone(), args.config.name.clone());
            let url = format!("{}/v1/models", args.config.http.trim_end_matches('/'));
            tasks.push(tokio::spawn(async move {
                let why = match AssertUnwindSafe(adapters::run(shared, name, url)).catch_unwind().await {
                    Ok(()) => "ended",
                    Err(_) => "panicked",
                };
                let _ = me.cast(ReplicaMsg::TaskEnded("adapters", why.into()));
            }));
        }
        Ok(ReplicaTasks { tasks })
    }

    async fn handle(
        &self,
        _me: ActorRef<ReplicaMsg>,
        msg: ReplicaMsg,
        _state: &mut ReplicaTasks,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ReplicaMsg::TaskEnded(task, why) => Err(format!("{task} task ended: {why}").into()),
        }
    }

    async fn post_stop(&self, _me: ActorRef<ReplicaMsg>, state: &mut ReplicaTasks) -> Result<(), ActorProcessingErr> {
        for t in state.tasks.drain(..) {
            t.abort();
        }
        Ok(())
    }
}

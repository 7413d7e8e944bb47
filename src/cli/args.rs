//! Argument definitions (clap derive). Defaults follow llama.cpp where a user would expect them to.

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::cli::UsageError;
use infer::engine::dry::{Dry, DryBreakers, DryParams};
use infer::engine::sampler::SamplerConfig;
use infer::model::backend::CacheType;
use infer::tokenizer::Tokenizer;

#[derive(Parser, Debug)]
#[command(
    name = "infer",
    version,
    about = "Run quantized GGUF language models on this machine"
)]
pub struct Cli {
    /// Print nothing on stderr but errors (no load line, speeds, notes or progress bars)
    #[arg(short, long, global = true)]
    pub quiet: bool,
    /// Where to compute: auto (a CUDA GPU when one is usable, else the CPU), cpu, or cuda
    #[arg(long, global = true, value_enum, value_name = "DEVICE")]
    pub device: Option<Device>,
    /// With CUDA: run only the first N layers on the GPU and the rest on the CPU (default: all)
    #[arg(long, global = true, value_name = "N")]
    pub gpu_layers: Option<usize>,
    #[command(subcommand)]
    pub command: Command,
}

/// `--device`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    Cuda,
}

impl From<Device> for infer::engine::load::Device {
    fn from(d: Device) -> Self {
        match d {
            Device::Auto => Self::Auto,
            Device::Cpu => Self::Cpu,
            Device::Cuda => Self::Cuda,
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate a continuation of a prompt
    Run(RunArgs),
    /// Print the token ids of a text as a JSON array
    Tokenize(TokenizeArgs),
    /// Talk with a model: an interactive chat using its chat template
    Chat(ChatArgs),
    /// Serve a model over HTTP: the OpenAI API (chat, completions, streaming) and a chat page
    Serve(crate::cli::serve::ServeArgs),
    /// Measure prompt processing and generation speed, and memory bandwidth
    Bench(BenchArgs),
    /// List the known models (aliases for --model): where each is and its size
    Models,
    /// Download known models into the user's model cache (verified by sha256, resumable)
    Pull(PullArgs),
    /// Remove models from the user's model cache
    Rm(RmArgs),
    /// Convert a Hugging Face checkpoint to GGUF, or re-quantize a GGUF file
    Quantize(QuantizeArgs),
    /// Check the CUDA kernels and a whole forward pass against the CPU backend (needs a GPU)
    Selftest(SelftestArgs),
    /// Perplexity of a model on a text (llama.cpp's method), optionally KL vs a base model
    Perplexity(PerplexityArgs),
    /// Collect an importance matrix (mean squared activations) for `quantize --imatrix`
    Imatrix(ImatrixArgs),
    /// Synthetic model files with a real model's shapes and random weights (GPU checks)
    #[command(hide = true)]
    Synth(crate::cli::synth::SynthArgs),
}

#[derive(Args, Debug)]
pub struct PullArgs {
    /// Model aliases from `infer models`
    #[arg(value_name = "ALIAS")]
    pub aliases: Vec<String>,
    /// Pull every known model
    #[arg(long, conflicts_with = "aliases")]
    pub all: bool,
}

#[derive(Args, Debug)]
pub struct RmArgs {
    /// Model aliases to remove from the cache
    #[arg(value_name = "ALIAS", required = true)]
    pub aliases: Vec<String>,
}

#[derive(Args, Debug)]
pub struct ImatrixArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// UTF-8 calibration text
    #[arg(short, long, value_name = "FILE")]
    pub file: PathBuf,
    /// Output file (llama.cpp's legacy imatrix.dat layout)
    #[arg(short, long, value_name = "FILE")]
    pub out: PathBuf,
    /// Tokens per window
    #[arg(short, long, default_value_t = 512)]
    pub ctx: usize,
    /// Use only the first N windows
    #[arg(long, value_name = "N")]
    pub chunks: Option<usize>,
}

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// UTF-8 text to score
    #[arg(short, long, value_name = "FILE")]
    pub file: PathBuf,
    /// Tokens per window; the second half of each window is scored
    #[arg(short, long, default_value_t = 512)]
    pub ctx: usize,
    /// Most tokens per forward call
    #[arg(short, long, default_value_t = 512)]
    pub batch: usize,
    /// Score only the first N windows
    #[arg(long, value_name = "N")]
    pub chunks: Option<usize>,
    /// Also run this base model on the same windows: mean KL(base || model), top-1 agreement
    #[arg(long, value_name = "BASE")]
    pub kl_divergence: Option<PathBuf>,
    /// Read the whole text through one --ctx window that shifts (context shift, KV never
    /// recomputed), 32 tokens a forward call, keeping the first --keep tokens as attention sinks;
    /// scores every token from position --ctx on
    #[arg(long, conflicts_with_all = ["kl_divergence", "sliding"])]
    pub context_shift: bool,
    /// With --context-shift: tokens kept at the start, rounded up to whole 32-token blocks (0: no
    /// sinks)
    #[arg(
        long,
        value_name = "N",
        default_value_t = 4,
        requires = "context_shift"
    )]
    pub keep: usize,
    /// The reference for --context-shift: every STRIDE tokens, recompute the --ctx tokens ending
    /// there from scratch and score the last STRIDE; scores the same tokens
    #[arg(long, value_name = "STRIDE", conflicts_with = "kl_divergence")]
    pub sliding: Option<usize>,
    /// One JSON object on stdout instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json)
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with = "input",
        required_unless_present = "input"
    )]
    pub from_hf: Option<PathBuf>,
    /// GGUF file to re-quantize
    #[arg(long = "in", value_name = "FILE")]
    pub input: Option<PathBuf>,
    /// Output GGUF file (written atomically)
    #[arg(short, long, value_name = "FILE")]
    pub out: PathBuf,
    /// Target type: a weight type for every eligible tensor (f16, q8_0, q4_0, q4_k, q6_k, ...; an
    /// unknown name is answered with the whole list), or the llama.cpp mixes q3_k_m, q4_k_m,
    /// q5_k_m
    #[arg(long = "type", value_name = "TYPE")]
    pub ty: String,
    /// Threads (default: the number of physical cores)
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Importance matrix (`infer imatrix`, or llama.cpp's legacy imatrix.dat) weighting the
    /// quantization error of the types whose ggml search uses one (the k-quants, q4_0..q5_1 and
    /// others; the rest ignore it)
    #[arg(long, value_name = "FILE")]
    pub imatrix: Option<PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// GGUF model file, or a known alias (see `infer models`)
    #[arg(short, long, value_name = "FILE|ALIAS")]
    pub model: PathBuf,
    /// Threads for computation (default: the number of physical cores)
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// KV cache type of the keys: f16, q8_0 or q4_0 (llama.cpp's names; quantized types run on
    /// the CPU)
    #[arg(long, value_name = "TYPE", default_value = "f16", value_parser = cache_type)]
    pub cache_type_k: CacheType,
    /// KV cache type of the values: f16, q8_0 or q4_0
    #[arg(long, value_name = "TYPE", default_value = "f16", value_parser = cache_type)]
    pub cache_type_v: CacheType,
    /// The global `--device` and `--gpu-layers`, copied here before the subcommand runs.
    #[arg(skip)]
    pub device: DeviceFlags,
}

/// A `--cache-type-k`/`--cache-type-v` value.
fn cache_type(s: &str) -> Result<CacheType, String> {
    CacheType::parse(s).ok_or_else(|| {
        let names: Vec<&str> = CacheType::ALL.iter().map(|t| t.name()).collect();
        format!(
            "unknown KV cache type {s:?}; use one of {}",
            names.join(", ")
        )
    })
}

/// `--device` (`None`: not given) and `--gpu-layers`, as the loader takes them.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceFlags {
    pub device: Option<Device>,
    pub gpu_layers: Option<usize>,
}

/// Sampling flags shared by `run` and `chat` (defaults as llama.cpp's).
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 = greedy
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Keep only the K most likely tokens (0 = off)
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability sums to P (1 = off)
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0 = off)
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalize tokens seen in the last 64 (1 = off)
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Subtract F from tokens seen in the last 64, once each (0 = off, -2..2)
    #[arg(
        long,
        value_name = "F",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub presence_penalty: f32,
    /// Subtract F per occurrence from tokens seen in the last 64 (0 = off, -2..2)
    #[arg(
        long,
        value_name = "F",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub frequency_penalty: f32,
    /// DRY: penalize tokens that extend a repeat of earlier text by F·base^(length − allowed)
    /// (0 = off; 0.8 is a common choice)
    #[arg(long, value_name = "F", default_value_t = 0.0)]
    pub dry_multiplier: f32,
    /// DRY: growth of the penalty per token of repeat
    #[arg(long, value_name = "B", default_value_t = 1.75)]
    pub dry_base: f32,
    /// DRY: repeats up to N tokens long are free
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub dry_allowed_length: usize,
    /// DRY: tokens searched for repeats (-1 = everything, 0 = off)
    #[arg(
        long,
        value_name = "N",
        default_value_t = 64,
        allow_negative_numbers = true
    )]
    pub dry_penalty_last_n: i64,
    /// DRY: a string no repeat may cross (repeatable; replaces the defaults \n : \" *; "none"
    /// for no breakers)
    #[arg(long, value_name = "STRING")]
    pub dry_sequence_breaker: Vec<String>,
    /// Random seed (default: from the clock)
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The sampler configuration, or a usage error naming the bad flag.
    pub fn config(&self) -> Result<SamplerConfig, UsageError> {
        if self.temp < 0.0 || !self.temp.is_finite() {
            return Err(UsageError(format!("--temp must be ≥ 0, got {}", self.temp)));
        }
        if !(0.0..=1.0).contains(&self.top_p) || !(0.0..=1.0).contains(&self.min_p) {
            return Err(UsageError("--top-p and --min-p must be within 0..1".into()));
        }
        for (flag, v) in [
            ("--presence-penalty", self.presence_penalty),
            ("--frequency-penalty", self.frequency_penalty),
        ] {
            // Also rejects NaN and infinities.
            if !(-2.0..=2.0).contains(&v) {
                return Err(UsageError(format!("{flag} must be within -2..2, got {v}")));
            }
        }
        self.dry_params()
            .check(|f| match f {
                "sequence_breakers" => "--dry-sequence-breaker".to_string(),
                f => format!("--dry-{}", f.replace('_', "-")),
            })
            .map_err(|(_, e)| UsageError(e))?;
        Ok(SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed.unwrap_or_else(SamplerConfig::entropy_seed),
            ..SamplerConfig::default()
        })
    }

    /// The DRY flags (checked by [`SamplingArgs::config`]).
    pub fn dry_params(&self) -> DryParams {
        let breakers = match self.dry_sequence_breaker.as_slice() {
            [] => DryParams::default().breakers,
            [none] if none == "none" => Vec::new(),
            given => given.to_vec(),
        };
        DryParams {
            multiplier: self.dry_multiplier,
            base: self.dry_base,
            allowed_length: self.dry_allowed_length,
            penalty_last_n: self.dry_penalty_last_n,
            breakers,
        }
    }

    /// The sampler's DRY penalty over `tok`'s vocabulary (`None` when off): call once the model
    /// is loaded.
    pub fn dry(&self, tok: &Tokenizer) -> Option<Arc<Dry>> {
        let p = self.dry_params();
        if !p.active() {
            return None;
        }
        p.with_breakers(Arc::new(DryBreakers::of(p.breakers.clone(), tok)))
    }
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text; `-` reads it from stdin (also the default when stdin is piped)
    #[arg(short, long, conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// Feed token ids directly, comma-separated (no tokenization, no BOS added)
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Maximum tokens to generate
    #[arg(short = 'n', long = "max-tokens", default_value_t = 256)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub constraint: ConstraintArgs,
    /// Context size in tokens (default: 4096, at most the model's training context)
    #[arg(short, long)]
    pub ctx: Option<usize>,
    /// Stop when this text appears (repeatable); it is not printed
    #[arg(long = "stop", value_name = "STR")]
    pub stop: Vec<String>,
    /// Do not add the BOS token even if the model asks for it
    #[arg(long)]
    pub no_bos: bool,
    /// Wrap the prompt in the model's chat template as one user message
    #[arg(long, conflicts_with = "prompt_ids")]
    pub chat: bool,
    /// System prompt for --chat
    #[arg(long, requires = "chat", value_name = "TEXT")]
    pub system: Option<String>,
    /// One JSON object per line: per token {"id","text"}, then a summary
    #[arg(long)]
    pub json: bool,
    /// With --json: add each token's "logprob" and the N most likely tokens ("top_logprobs"),
    /// log-softmax of the raw logits (before temperature, penalties and truncation)
    #[arg(long, value_name = "N", requires = "json")]
    pub logprobs: Option<usize>,
    /// Run every request of a JSON-lines file (`-` = stdin), {"prompt","max_tokens"} plus optional
    /// "temperature", "seed", "stop"; one JSON result line per request, in order
    #[arg(long, value_name = "FILE", conflicts_with_all = ["prompt", "prompt_ids", "logprobs"])]
    pub batch_file: Option<PathBuf>,
    /// Save the prompt's KV cache to FILE, and on a later run whose prompt starts the same way
    /// load it instead of computing it (whole 512-token chunks, or all of an identical prompt;
    /// the output is the same). A file from another model or damaged is said and recomputed
    #[arg(long, value_name = "FILE", conflicts_with = "batch_file")]
    pub prompt_cache: Option<PathBuf>,
    /// When the context is full, keep the first --keep tokens (attention sinks), drop the oldest
    /// 32-token block after them and go on, for any number of tokens (StreamingLLM)
    #[arg(long, conflicts_with = "batch_file")]
    pub context_shift: bool,
    /// With --context-shift: tokens kept at the start (after BOS), rounded up to whole 32-token
    /// blocks
    #[arg(
        long,
        value_name = "N",
        default_value_t = 4,
        requires = "context_shift"
    )]
    pub keep: usize,
    /// Keep generating past end-of-generation tokens, to -n tokens (benchmarks, tests)
    #[arg(long)]
    pub ignore_eos: bool,
    /// With --batch-file: run up to N requests at once (continuous batching; each one's text is
    /// what it gets alone). KV is reserved for N sequences of --ctx positions
    #[arg(long, value_name = "N", default_value_t = 8, requires = "batch_file",
          value_parser = clap::value_parser!(u64).range(1..=256))]
    pub parallel: u64,
}

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// System prompt
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Jinja chat template file to use instead of the model's
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Maximum tokens per answer
    #[arg(short = 'n', long = "max-tokens", default_value_t = 512)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub constraint: ConstraintArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Context size in tokens (default: 4096, at most the model's training context)
    #[arg(short, long)]
    pub ctx: Option<usize>,
    /// Do not read or write the input history file
    #[arg(long)]
    pub no_history: bool,
    /// When an answer fills the context, keep the first --keep tokens (attention sinks), drop the
    /// oldest 32-token block after them and go on (StreamingLLM) instead of cutting the answer
    #[arg(long)]
    pub context_shift: bool,
    /// With --context-shift: tokens kept at the start (after BOS), rounded up to whole 32-token
    /// blocks
    #[arg(
        long,
        value_name = "N",
        default_value_t = 4,
        requires = "context_shift"
    )]
    pub keep: usize,
}

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text to tokenize (`-` or absent: read stdin)
    pub text: Option<String>,
    /// Do not add BOS even if the model asks for it
    #[arg(long)]
    pub no_bos: bool,
    /// Treat special-token text like `<|im_start|>` as plain text
    #[arg(long)]
    pub no_special: bool,
    /// Read one JSON string per stdin line; write one JSON array of ids per line
    #[arg(long, conflicts_with = "text")]
    pub jsonl: bool,
}

#[derive(Args, Debug)]
pub struct SelftestArgs {
    /// Also compare a whole forward pass of this model (a path or alias)
    #[arg(short, long, value_name = "FILE|ALIAS")]
    pub model: Option<PathBuf>,
    /// Prompt tokens of the forward comparison
    #[arg(long, default_value_t = 48)]
    pub tokens: usize,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens processed in one batch (0 = skip the pp test); with --concurrency, each
    /// request's prompt [default: 512; with --concurrency 32]
    #[arg(short = 'p', long = "n-prompt")]
    pub n_prompt: Option<usize>,
    /// Tokens generated one at a time (0 = skip the tg test)
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub n_gen: usize,
    /// Repetitions of each test
    #[arg(short = 'r', long = "reps", default_value_t = 5)]
    pub reps: usize,
    /// Tokens already in the context before each test
    #[arg(short = 'd', long, default_value_t = 0)]
    pub depth: usize,
    /// Serving test instead of pp/tg: at each level, that many requests at once (random
    /// prompts of -p tokens, -n tokens each, greedy) through the scheduler: aggregate tokens/s,
    /// time to first token and inter-token latency; -r rounds a level
    #[arg(long, value_name = "N,N,..", value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=256))]
    pub concurrency: Vec<u64>,
    /// With --concurrency: also 8 requests sharing a prefix of this many tokens, the first
    /// alone, the other 7 once it has its first token (0 = skip)
    #[arg(
        long,
        value_name = "TOKENS",
        default_value_t = 1000,
        requires = "concurrency"
    )]
    pub shared_prefix: usize,
    /// With the model on a GPU: also time every kernel of 16 decode steps one by one (CUDA
    /// events around each launch, graphs off) and print each kernel's time and achieved
    /// bandwidth per token
    #[arg(long, conflicts_with = "concurrency")]
    pub profile: bool,
    /// Measure structured output's cost: decode with and without this JSON schema (a file, or
    /// the schema itself) in the same run, and the mask time per token
    #[arg(long, value_name = "FILE|JSON", conflicts_with_all = ["concurrency", "profile", "kv_types"])]
    pub json_schema: Option<String>,
    /// Time each of these KV cache types in the same run, one after another in every
    /// repetition: comma-separated, each `T` (keys and values) or `K/V`, e.g. `f16,q8_0`
    #[arg(
        long,
        value_name = "T,..",
        value_delimiter = ',',
        value_parser = kv_pair,
        conflicts_with_all = ["concurrency", "cache_type_k", "cache_type_v"]
    )]
    pub kv_types: Vec<(CacheType, CacheType)>,
    /// One JSON object on stdout instead of the table
    #[arg(long)]
    pub json: bool,
}

/// A `--kv-types` entry: `T` for keys and values, or `K/V`.
fn kv_pair(s: &str) -> Result<(CacheType, CacheType), String> {
    match s.split_once('/') {
        Some((k, v)) => Ok((cache_type(k)?, cache_type(v)?)),
        None => cache_type(s).map(|t| (t, t)),
    }
}

/// Speculative decoding flags of `run`.
#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// Prompt-lookup speculative decoding: draft the tokens that followed the latest earlier
    /// occurrence of the last N tokens (longest n-gram tried; 0 = off) and verify them in one
    /// forward. Greedy output is unchanged; sampling keeps the model's distribution
    #[arg(long, value_name = "N", default_value_t = 0, conflicts_with_all = ["draft_model", "self_draft"])]
    pub lookup: usize,
    /// Speculative decoding with a smaller draft model (same vocabulary), run on the CPU
    #[arg(long, value_name = "FILE", conflicts_with = "self_draft")]
    pub draft_model: Option<std::path::PathBuf>,
    /// Self-speculative decoding: draft with the model's first LAYERS layers (early exit)
    #[arg(long, value_name = "LAYERS", value_parser = clap::value_parser!(u64).range(1..))]
    pub self_draft: Option<u64>,
    /// Most tokens drafted per step (the draft length adapts below it)
    #[arg(long, value_name = "K", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub draft_max: u64,
    /// Adapt the draft length to acceptance only, not to the measured cost of verify forwards
    #[arg(long)]
    pub no_cost_k: bool,
}

/// Structured output flags of `run` and `chat`: at most one constraint.
#[derive(Args, Debug, Clone, Default)]
pub struct ConstraintArgs {
    /// Constrain the output to JSON valid under this schema: a file, or the schema itself
    /// (text starting with `{`)
    #[arg(long, value_name = "FILE|JSON", conflicts_with_all = ["grammar", "regex"])]
    pub json_schema: Option<String>,
    /// Constrain the output to a grammar: GBNF (llama.cpp's dialect) or, for a `.lark` file,
    /// llguidance's Lark dialect
    #[arg(long, value_name = "FILE", conflicts_with = "regex")]
    pub grammar: Option<PathBuf>,
    /// Constrain the output to match a regular expression (Rust `regex` syntax) as a whole
    #[arg(long, value_name = "REGEX")]
    pub regex: Option<String>,
}

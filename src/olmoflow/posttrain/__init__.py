"""Post-training: chat templates (:mod:`olmoflow.tokenizer.chat`), data readers for
conversations and preference pairs (:mod:`olmoflow.posttrain.data`,
:mod:`olmoflow.posttrain.formats`) and the losses (:mod:`olmoflow.posttrain.losses`): the ground
the SFT, DPO and RL-with-verifiable-rewards trainers build on."""
